"""This rank's blocks of one full tensor, as torch's distributed checkpoint (DCP) saves and loads them.

Every backend keeps its part of a parameter (and of the optimizer's state for it) its own way: a range of
the flattened tensor (FSDP1, ZeRO), a block of rows or columns (FSDP2, tensor parallelism), or all of it.
``Blocks`` shows DCP any of these as rectangular boxes of the full shape, each a view of this rank's own
storage: DCP writes each box where it lies in the full tensor, and on a load reads into each box the
overlapping parts of whatever boxes another layout wrote. A range of the flattened tensor is cut into at
most ``2 * ndim - 1`` boxes (``boxes``), each a contiguous run of it.

DCP finds these methods on any ``torch.Tensor`` subclass (``torch.distributed.checkpoint`` checks for
``__create_write_items__``, ``__create_chunk_list__`` and ``__get_tensor_shard__``); nothing else of the
subclass is used, so it refuses every other operation.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Blocks", "boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the full tensor


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Elements ``[start, stop)`` of a flattened tensor of ``shape`` as boxes, in order; each box is a
    contiguous run of the flattened tensor."""
    shape = tuple(int(n) for n in shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    if start % inner:  # a partial first row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], start - row * inner, end - row * inner)]
        start = end
    first, last = -(-start // inner), stop // inner
    if last > first:  # whole rows
        out.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if stop % inner and stop > start:  # a partial last row
        row = stop // inner
        lo = max(start, row * inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], lo - row * inner, stop - row * inner)]
    return out


class Blocks(torch.Tensor):
    """Boxes of a tensor of ``shape``: ``parts`` pairs each ``(offsets, sizes)`` with the tensor holding its
    values (of those sizes; a view of this rank's storage, written in place on a load)."""

    _parts: list[tuple[Box, torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], parts: list[tuple[Box, torch.Tensor]], dtype: torch.dtype) -> Blocks:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype,  # type: ignore[attr-defined]
                                                device=torch.device("cpu"))
        t._parts = parts
        return t  # type: ignore[no-any-return]

    def __init__(self, shape: Sequence[int], parts: list[tuple[Box, torch.Tensor]], dtype: torch.dtype) -> None:
        super().__init__()

    def fill_from(self, full: torch.Tensor) -> None:
        """Write each box's values from ``full`` (the whole tensor)."""
        for (offsets, sizes), values in self._parts:
            values.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Blocks(shape={tuple(self.shape)}, boxes={[b for b, _ in self._parts]})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func is torch.ops.aten.detach.default:  # DCP detaches what it is given
            return args[0]
        raise NotImplementedError(f"Blocks only carries boxes to torch.distributed.checkpoint, not {func}")

    # -- what DCP asks of a checkpointable tensor ---------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for (offsets, sizes), values in self._parts:
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                       sizes=torch.Size(sizes)),
                                            properties=TensorProperties.create_from_tensor(values),
                                            size=self.shape)))
        return items

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for (o, s), _ in self._parts]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        want = tuple(index.offset)
        for (offsets, _), values in self._parts:
            if offsets == want:
                return _exact(values)
        raise KeyError(f"no box at {want} in {self!r}")


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on the CPU) as a tensor whose storage is exactly its own bytes, the same memory.

    DCP's writer copies a CPU tensor whose storage is larger than the tensor before writing it, and keeps each
    copy until the rank's file is complete: for boxes that are views of a larger buffer (a DeepSpeed partition,
    an FSDP1 flat shard) that is a second copy of the rank's whole share. A tensor over just those bytes is
    written from the memory it views. It lives no longer than ``Blocks``, which keeps the buffer alive."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    memory = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    return torch.frombuffer(memory, dtype=t.dtype).view(t.shape)
