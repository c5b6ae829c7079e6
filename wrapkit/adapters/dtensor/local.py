"""What this rank holds of DTensor parameters, without a collective: the pieces a load writes, the shard map, local
bytes and placement."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..._gather import walk_tensors
from ..core.parts import flat_view, local_tensor
from ..core.primitives import Piece, copy_into
from .layout import is_dtensor, shard_key

Shape = tuple[int, ...]

__all__ = ["_block_writer", "_local_flat", "load_piece", "local_bytes", "local_layout", "local_placement", "pieces",
           "shard_map"]


def load_piece(name: str, p: Any) -> Piece | None:
    """This rank's part of DTensor ``p`` for a load (None: it holds nothing): a contiguous range of the
    flattened full parameter where only its first dimension is split, else its block of the whole."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = local_tensor(p)
    full_shape = tuple(p.shape)
    if local.numel() == 0:
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) == full_shape[1:] and local.is_contiguous():
        row = math.prod(full_shape[1:])
        return Piece(name, offset[0] * row, local.numel(), full_shape, copy_into(local), source=p,
                     values=_local_flat)
    block = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    # A block read as one box: only where it is one (a strided shard's rows are not).
    strided = any(type(pl).__name__ == "_StridedShard" for pl in p.placements)
    return Piece(name, 0, p.numel(), full_shape, _block_writer(local, full_shape, block),
                 source=None if strided else p, values=None if strided else local_tensor,
                 box=(tuple(offset), tuple(shape)))


def _local_flat(t: Any) -> torch.Tensor:
    return local_tensor(t).detach().view(-1)


def _block_writer(local: torch.Tensor, full_shape: Shape, block: tuple[slice, ...]) -> Any:
    def write(values: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(values.reshape(full_shape)[block])
    return write


# -- what an adapter over DTensor parameters shares (fsdp2, tp) ------------------------------------------
def shard_map(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]]:
    """Name -> (this rank's shard, its shard key) for ``local_shards``; a plain tensor is whole on every rank."""
    out: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {}
    meshes: dict[int, tuple[Any, ...]] = {}
    for name, p in named:
        if not is_dtensor(p):
            out[name] = (p.data, ("full", tuple(p.shape)))
            continue
        local = local_tensor(p)
        out[name] = (local, shard_key(p, local, meshes))
    return out


def local_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``params``: a DTensor's local shard, a plain tensor whole."""
    return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params)


def local_placement(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``placement_tensors`` with each DTensor's local shard in its place, which is what moves."""
    for name, t in named:
        yield (f"{name} (local shard)", local_tensor(t)) if is_dtensor(t) else (name, t)


def local_layout(root: torch.nn.Module) -> list[torch.Tensor]:
    """``layout_tensors``: this rank's shard of every parameter, then every buffer, module by module.
    Straight from each module's dicts: ``parameters()`` and ``buffers()`` cost several times more,
    and a cached sync reads this at every call."""
    return walk_tensors(root, local_tensor)


def pieces(named: Iterable[tuple[str, torch.Tensor]]) -> list[Piece]:
    """This rank's part of every parameter for ``load_pieces``: a DTensor's block, a plain tensor whole."""
    out: list[Piece] = []
    for name, p in named:
        if not is_dtensor(p):
            out.append(Piece(name, 0, p.numel(), tuple(p.shape), copy_into(p.data), source=p, values=flat_view))
        elif (piece := load_piece(name, p)) is not None:
            out.append(piece)
    return out
