"""The safetensors format as wrapkit writes it, one home for ``save``, ``save_pretrained`` and
``load``: the dtype table (whatever the writer writes, the reader reads), file writing straight
from the tensors' memory, and the atomic commits: a file renamed over its path, a directory
swapped with the previous checkpoint, the leftovers of killed saves swept."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import StateDictError

__all__ = ["INDEX_NAME", "SINGLE_NAME", "SAFETENSORS_DTYPES", "outside", "safetensors_name", "torch_dtype",
           "write_file", "write_file_atomic", "fsync_dir", "temporary_dir", "sweep", "commit_dir"]


# The Hugging Face layout's file names: the index of a sharded checkpoint, and a checkpoint of one file.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def outside(directory: str, name: str) -> str | None:
    """Where ``name`` (a file a checkpoint in ``directory`` names: relative, absolute, through symbolic
    links) really leads, when that is not inside ``directory``; None when it stays inside. A checkpoint is
    read from its own directory only: an index naming ``../x`` would read any file the account can, and
    make the checkpoint depend on files that are not part of it."""
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(directory, name))
    return None if os.path.commonpath([root, real]) == root and real != root else real


def _table() -> dict[str, torch.dtype]:
    # Some dtypes are newer than the oldest torch supported (the unsigned ones, float8 E8M0):
    # each is in the table only where this torch has it.
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
             "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
    out = {}
    for name, attr in names.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            out[name] = dtype
    return out


SAFETENSORS_DTYPES: dict[str, torch.dtype] = _table()
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors header name of ``dtype``; None where safetensors cannot store it."""
    return _NAMES.get(dtype)


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header name; None where this torch has none for it."""
    return SAFETENSORS_DTYPES.get(name)


# -- files ------------------------------------------------------------------------------------
def write_file(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """One safetensors file at the new path ``path``, written straight from the tensors' memory and
    fsynced. (safetensors' own ``save_file`` first copies every tensor into one buffer, which
    doubles the memory a writer holds, and refuses tensors that share storage.) The format: an
    8-byte little-endian header length, a JSON header (dtype, shape and byte range of each tensor),
    then the tensors' bytes end to end."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        st_dtype = safetensors_name(t.dtype)
        if st_dtype is None:
            raise StateDictError(f"{name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "xb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """``write_file`` to a temporary file beside ``path``, renamed over it: ``path`` holds either
    its previous file or the whole new one, and a failed write leaves no temporary file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write_file(tensors, tmp)
        os.replace(tmp, path)  # the commit point
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make the renames inside ``directory`` durable, where the platform can."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- directories --------------------------------------------------------------------------
_TMP, _OLD = ".wrapkit-tmp-", ".wrapkit-old-"


def temporary_dir(directory: str) -> str:
    """A new, empty directory beside ``directory`` to fill before ``commit_dir``; this package's
    leftovers of ``directory`` are swept first."""
    sweep(directory)
    parent, base = os.path.split(os.path.abspath(directory))
    tmp = os.path.join(parent, f".{base}{_TMP}{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return int(fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)) == 0


def sweep(directory: str) -> None:
    """Remove this package's leftovers of ``directory`` (from killed saves); first put back a
    previous checkpoint that a killed save had moved aside and not yet replaced."""
    parent, base = os.path.split(os.path.abspath(directory))
    leftovers = [n for n in os.listdir(parent) if n.startswith(f".{base}{_TMP}") or n.startswith(f".{base}{_OLD}")]
    if not os.path.exists(directory):
        aside = sorted(n for n in leftovers if n.startswith(f".{base}{_OLD}"))
        if aside:
            os.replace(os.path.join(parent, aside[-1]), directory)
            leftovers.remove(aside[-1])
    for name in leftovers:
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def commit_dir(tmp: str, directory: str) -> None:
    """Put the complete ``tmp`` at ``directory``: the previous checkpoint there stays whole until then."""
    fsync_dir(tmp)
    parent, base = os.path.split(os.path.abspath(directory))
    if not os.path.exists(directory):
        os.replace(tmp, directory)
    elif _exchange(tmp, directory):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
    else:
        # Two renames; a kill between them leaves the previous checkpoint aside, which the
        # next save (``sweep``) puts back before anything else.
        aside = os.path.join(parent, f".{base}{_OLD}{uuid.uuid4().hex[:8]}")
        os.replace(directory, aside)
        try:
            os.replace(tmp, directory)
        except OSError:
            os.replace(aside, directory)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(parent)
