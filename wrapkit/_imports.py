"""Lazy look-ups of optional libraries.

Nothing here imports an optional library. A class is looked up in ``sys.modules``:
an object cannot be an instance of a class whose module was never imported, so
detection costs nothing and never drags deepspeed or peft into a process that
does not use them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

from ._errors import MissingDependencyError

__all__ = ["lookup", "is_instance", "is_available", "require", "version_of"]


def lookup(module: str, qualname: str) -> type | None:
    """Return ``module.qualname`` if ``module`` is already imported, else ``None``."""
    mod = sys.modules.get(module)
    if mod is None:
        return None
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, type) else None


def is_instance(obj: object, module: str, qualname: str) -> bool:
    """``isinstance(obj, module.qualname)`` without importing ``module``."""
    cls = lookup(module, qualname)
    return cls is not None and isinstance(obj, cls)


def is_available(package: str) -> bool:
    """Whether ``package`` could be imported, checked without importing it."""
    if package in sys.modules:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, *, feature: str, extra: str | None = None) -> ModuleType:
    """Import ``package`` for ``feature`` or raise a ``MissingDependencyError`` that says how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        hint = f"pip install 'wrapkit[{extra}]'" if extra else f"pip install {package}"
        raise MissingDependencyError(
            f"{feature} needs the optional package {package!r}, which could not be imported ({exc}); "
            f"install it with `{hint}`."
        ) from exc


def version_of(package: str) -> str | None:
    """Installed version of ``package`` (from its metadata, without importing it), or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
