"""Checks of the public API's plain arguments: a flag must be a bool, a path a ``str`` or
``os.PathLike``. A wrong type raises ``ArgumentError`` naming the argument, before anything is done
(truthiness would silently read ``"no"`` as yes)."""

from __future__ import annotations

import os
from typing import Any

from .._errors import ArgumentError

__all__ = ["flag", "path", "names"]


def flag(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{where}({name}=...) takes True or False, got {value!r} ({type(value).__name__})")
    return value


def path(value: Any, name: str, where: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"{where}({name}=...) takes a path (str or os.PathLike), got {value!r} "
                            f"({type(value).__name__})")
    return os.fspath(value)


def names(value: Any, name: str, where: str) -> list[str] | None:
    """None, or a sequence of names (one ``str`` is taken as one name)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ArgumentError(f"{where}({name}=...) takes a list of names (str), got {value!r} ({type(value).__name__})")
