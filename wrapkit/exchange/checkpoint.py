"""Checkpoints of one file: the full state dict written atomically by rank 0 (``save``), and
read whole (``read_checkpoint``); ``reading.load`` loads it, or a sharded directory, into a
model. A write failure on rank 0 is agreed on across the group (``_agree``), so every rank
raises alike and none waits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .._agree import Call, any_over_models, enter, raise_agreed, writes_files
from .._errors import StateDictError
from .._imports import require
from ..base import args as _args
from ..formats.safetensors import write_file_atomic
from .state_dict import gather_state_dict

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["save", "read_checkpoint"]


def save(wm: Adapter, path: str | os.PathLike[str]) -> None:
    """Write the full state dict to one safetensors file, atomically, from rank 0.

    Every rank must call it. Rank 0 writes a temporary file in the same directory,
    fsyncs it and renames it over ``path``, so an interrupted save never leaves a
    partial file at ``path``. Returns on every rank once the file is in place.
    """
    path = os.fspath(path)
    writer = writes_files(wm)
    problems: list[str] = []
    if writer:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            problems.append(f"directory {directory!r} does not exist; create it first")
        elif os.path.isdir(path):
            example = os.path.join(path, "model.safetensors")
            problems.append(f"{path!r} is a directory; pass a file path such as {example!r}")
    # The path is not compared across ranks: only rank 0's is written to.
    [agreed] = enter(Call.of("save"), wm, flags=[bool(problems)], invalid=1)
    raise_agreed(problems, f"save to {path!r}", "Pass the path of a file in an existing directory.", wm,
                 agreed=agreed)
    sd = gather_state_dict(wm, rank0_only=True)
    error: BaseException | None = None
    if writer:
        try:
            write_file_atomic(sd, path)
        except Exception as exc:
            error = exc
    if any_over_models(error is not None, wm):
        cause = f"{type(error).__name__}: {error}" if error is not None else "see rank 0's error"
        raise StateDictError(
            f"rank 0 could not write {path!r} ({cause}); any earlier file there is untouched and the "
            "temporary file was removed. Check the free space and permissions of that directory."
        ) from error


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a safetensors file into CPU tensors. No collective.

    :param path: the ``.safetensors`` file.
    :raises StateDictError: the file is missing, truncated or corrupt.
    :raises ArgumentError: ``path`` is not a path.
    :raises MissingDependencyError: safetensors is not installed.
    """
    path = _args.path(path, "path", "read_checkpoint")
    st = require("safetensors.torch", feature="loading a safetensors checkpoint", extra="transformers")
    if not os.path.isfile(path):
        raise StateDictError(f"no checkpoint file at {path!r}; pass the path that save() wrote")
    try:
        sd: dict[str, torch.Tensor] = st.load_file(path, device="cpu")
    except Exception as exc:  # safetensors raises its own error type (and OSError for I/O)
        raise StateDictError(
            f"{path!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); it is truncated or "
            "corrupt. Save it again, or load an earlier checkpoint."
        ) from exc
    return sd

