"""Reading the tensor records of torch's distributed checkpoint straight into the tensors they load.

DCP's file reader gives each tensor record (a ``torch.save`` archive: a zip holding a small pickle that
describes the tensor and the raw bytes of its storage) to ``torch.load``, then copies the result into the
tensor being loaded. For the many small records of a checkpoint in boxes (``dcp.py``), the unpickling costs
more than the bytes. ``read_record`` reads the archive's directory and its pickle instead, the pickle by an
unpickler that knows only how a tensor is rebuilt (no other class, nothing run), and when the record is one
plain tensor (contiguous, from the start of its storage, of a dtype it names) reads the bytes straight into
the destination. Anything else (another archive layout, a compressed entry, a view into a larger storage)
is left to ``torch.load``: the caller falls back.
"""

from __future__ import annotations

import collections
import ctypes
import io
import math
import pickle
import struct
from typing import IO, Any, NamedTuple

import torch

__all__ = ["Record", "describe", "read_record"]

_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: signature, disks, counts, size, offset, comment
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # a central directory entry, its name and extras after it
_LOCAL = struct.Struct("<4s5H3L2H")  # a local file header, its name and extras after it


class Record(NamedTuple):
    """One plain tensor in a record: its dtype and shape, and where its bytes start in the record."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: int


class _Tensor(NamedTuple):
    storage: tuple[str, str, int]  # (storage class name, key, numel)
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> _Tensor:
    return _Tensor(storage, offset, tuple(size), tuple(stride))


class _Describe(pickle.Unpickler):
    """Unpickles what ``torch.save`` writes for one tensor into its description alone."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGES):
            raise pickle.UnpicklingError("not a tensor storage")
        return (pid[1], str(pid[2]), int(pid[4]))


def _entries(f: IO[bytes], start: int, length: int) -> dict[str, tuple[int, int, int]] | None:
    """Name -> (local header offset, method, size) of the archive at ``[start, start + length)``, or None."""
    if length < _EOCD.size:
        return None
    f.seek(start + length - _EOCD.size)
    sig, _, _, _, count, size, offset, comment = _EOCD.unpack(f.read(_EOCD.size))
    if sig != b"PK\x05\x06" or comment or offset == 0xFFFFFFFF or offset + size > length:
        return None  # a comment moves the end record; zip64 archives keep their offsets elsewhere
    f.seek(start + offset)
    table = f.read(size)
    out: dict[str, tuple[int, int, int]] = {}
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > len(table):
            return None
        fields = _CENTRAL.unpack_from(table, at)
        if fields[0] != b"PK\x01\x02":
            return None
        method, size_, name_len, extra_len, comment_len, local = fields[4], fields[9], fields[10], fields[11], \
            fields[12], fields[16]
        name = table[at + _CENTRAL.size:at + _CENTRAL.size + name_len].decode("utf-8", "replace")
        out[name] = (local, method, size_)
        at += _CENTRAL.size + name_len + extra_len + comment_len
    return out


def _data_at(f: IO[bytes], start: int, local: int) -> int | None:
    """Where the data of the entry whose local header is at ``local`` starts, relative to the record."""
    f.seek(start + local)
    header = f.read(_LOCAL.size)
    if len(header) < _LOCAL.size:
        return None
    fields = _LOCAL.unpack(header)
    return None if fields[0] != b"PK\x03\x04" else local + _LOCAL.size + fields[9] + fields[10]


def describe(f: IO[bytes], start: int, length: int) -> Record | None:
    """The plain tensor the record at ``[start, start + length)`` of ``f`` holds, or None where it is anything
    else."""
    entries = _entries(f, start, length)
    if entries is None:
        return None
    pkl = [n for n in entries if n.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    archive = pkl[0][:-len("data.pkl")]
    local, method, size = entries[pkl[0]]
    at = _data_at(f, start, local)
    if at is None or method != 0:
        return None
    f.seek(start + at)
    try:
        t = _Describe(io.BytesIO(f.read(size))).load()
    except Exception:  # anything but one plain tensor
        return None
    if not isinstance(t, _Tensor) or t.offset != 0:
        return None
    kind, key, numel = t.storage
    dtype = _STORAGES[kind]
    stride, expect = [], 1
    for n in reversed(t.size):
        stride.append(expect)
        expect *= n
    if tuple(reversed(stride)) != t.stride and math.prod(t.size) > 1:
        return None
    found = entries.get(f"{archive}data/{key}")
    if found is None or found[1] != 0 or numel != math.prod(t.size) or \
            found[2] != numel * dtype.itemsize:
        return None
    data = _data_at(f, start, found[0])
    return None if data is None else Record(dtype, t.size, data)


def read_record(f: IO[bytes], start: int, length: int, offsets: tuple[int, ...], lengths: tuple[int, ...],
                target: torch.Tensor) -> bool:
    """Read the part ``offsets``/``lengths`` of the tensor recorded at ``[start, start + length)`` of ``f`` into
    ``target`` (a CPU tensor of those lengths); False, with nothing written, where the record is not one plain
    tensor of ``target``'s dtype."""
    record = describe(f, start, length)
    if record is None or record.dtype != target.dtype or target.device.type != "cpu" or \
            tuple(target.shape) != tuple(lengths) or len(offsets) != len(record.shape):
        return False
    f.seek(start + record.data)
    whole = all(o == 0 for o in offsets) and tuple(lengths) == record.shape
    if whole and target.is_contiguous():
        _read_into(f, target)  # the file's bytes straight into the destination
        return True
    stored = torch.empty(record.shape, dtype=record.dtype)
    _read_into(f, stored)
    part = stored
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        part = part.narrow(dim, o, n)
    target.copy_(part)
    return True


def _read_into(f: IO[bytes], t: torch.Tensor) -> None:
    if t.nbytes == 0:
        return
    view = memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")
    got = 0
    while got < t.nbytes:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise OSError(f"a checkpoint record ends {t.nbytes - got} bytes early")
        got += n
