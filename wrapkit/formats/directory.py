"""A save into a directory, collectively and atomically: a temporary directory beside the target, made by the
writing rank and known to every rank, completed and swapped in only when no rank failed, removed otherwise.
``save_pretrained``, its adapters-only form and ``save_state`` write through it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from .._agree import Call, Ranks, any_over_models, broadcast_object, enter, models_group, raise_agreed, writes_files
from .._errors import StateDictError
from . import safetensors as _safetensors

__all__ = ["open_directory", "commit_directory"]


def _share(value: Any, wm: Ranks) -> Any:
    """``value`` as the first replica's rank 0 has it, on every rank (its shard group, then across
    the replicas)."""
    use, group = models_group(wm)
    if not use:
        return value
    for g in [group, *wm.outer_groups()]:
        value = broadcast_object(value, 0, g)
    return value


def open_directory(wm: Ranks, directory: str | os.PathLike[str], call: Call, problems: list[str],
                   fix: str) -> tuple[str, str]:
    """The start of a save into a directory, collective: ``directory`` checked, a temporary
    directory made beside it by the writing rank, ``call`` entered, and every problem (``problems``
    and those found here) raised alike on every rank. Returns the absolute directory and the
    temporary one, the same on every rank."""
    directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(directory)
    rank0 = writes_files(wm)
    if not os.path.isdir(parent):
        problems.append(f"directory {parent!r} does not exist; create it first")
    elif os.path.exists(directory) and not os.path.isdir(directory):
        problems.append(f"{directory!r} is a file; pass a directory path")
    tmp = ""
    if rank0 and not problems:
        try:
            tmp = _safetensors.temporary_dir(directory)
        except OSError as exc:
            problems.append(f"cannot create a temporary directory beside {directory!r}: {exc}")
    try:
        [agreed] = enter(call, wm, flags=[bool(problems)], invalid=1)
        raise_agreed(problems, f"{call.op} to {directory!r}", fix, wm, agreed=agreed)
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory, _share(tmp, wm)


def commit_directory(wm: Ranks, op: str, directory: str, tmp: str, error: BaseException | None,
                     finish: Callable[[str], None]) -> None:
    """The end of a save into a directory, collective: unless some rank failed (``error`` on this
    one), the writing rank completes ``tmp`` with ``finish(tmp)`` and swaps it in. On any failure the
    temporary directory goes, the previous checkpoint stays, and every rank raises ``StateDictError``."""
    rank0 = writes_files(wm)
    if not any_over_models(error is not None, wm) and rank0:
        try:
            finish(tmp)
            _safetensors.commit_dir(tmp, directory)
        except Exception as exc:
            error = exc
    if any_over_models(error is not None, wm):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = f"{type(error).__name__}: {error}" if error is not None else "see the writing rank's error"
        raise StateDictError(
            f"{op} could not write {directory!r} ({cause}); any earlier checkpoint there is untouched and the "
            "temporary directory was removed. Check the free space and permissions."
        ) from error
