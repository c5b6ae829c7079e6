"""FSDP1's ``FlatParameter``: where each original parameter lies in a unit's flat shard.

FSDP1 has no public per-parameter API. The private fields read here (``_fqns``, ``_params``,
``_shapes``, ``_numels_with_padding``, ``_is_padding_mask``, ``_shard_param_infos``,
``_local_shard``) are documented on ``FlatParameter`` in torch/distributed/fsdp/_flat_param.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..._gather import all_gather_into
from ..._names import canonical_name
from ..core.parts import flat_view
from ..core.primitives import Piece, copy_into

__all__ = ["local_shard", "flat_pieces", "flat_parameter_names", "gather_in", "full_from_shards"]


def local_shard(flat: Any) -> torch.Tensor:
    """This rank's (padded) shard of a unit's flat parameter. ``_local_shard`` appears at FSDP's
    lazy init (the first forward); until then the flat parameter itself holds the shard."""
    local: torch.Tensor | None = getattr(flat, "_local_shard", None)
    out: torch.Tensor = flat.data if local is None else local
    return out


def flat_pieces(root: torch.nn.Module, handles: Iterable[Any]) -> list[Piece]:
    """The ranges of original parameters that this rank's shard of each unit holds."""
    # The original parameters' names: each registered one's (use_orig_params=True), or those a registered flat
    # parameter stands for, in its order (use_orig_params=False).
    names = flat_parameter_names(root)
    out: list[Piece] = []
    for handle in handles:
        flat = handle.flat_param
        if handle.uses_sharded_strategy and local_shard(flat).data_ptr() != flat.data_ptr():
            # Left unsharded by a forward (FSDP keeps the root so): its full copy would
            # outlive the write and be used as is by the next forward.
            handle.reshard(True)
            handle.post_reshard()
            handle._prefetched = False
        shard = local_shard(flat)
        for i, info in enumerate(flat._shard_param_infos):
            if not info.in_shard:
                continue
            start, n = int(info.offset_in_shard), int(info.numel_in_shard)
            # An optimizer holds the original parameters (use_orig_params=True: each a 1-D view of its
            # range of the shard), or the flat parameter itself.
            if flat._params is not None:
                name = names[id(flat._params[i])][0]
                source, values = flat._params[i], flat_view
            else:
                name = names[id(flat)][i]
                source, values = flat, _range(start, n)
            out.append(Piece(name, int(info.intra_param_start_idx), n, tuple(flat._shapes[i]),
                             copy_into(shard[start:start + n]), source=source, values=values))
    return out


def flat_parameter_names(root: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> canonical names: a flat parameter (use_orig_params=False) stands for every original
    parameter of its unit, in its order."""
    out: dict[int, list[str]] = {}
    for name, p in root.named_parameters():
        if getattr(p, "_fqns", None) is not None and getattr(p, "_params", None) is None:
            prefix = name.rpartition(".")[0]
            fqns: list[str] = p._fqns  # type: ignore[attr-defined]
            out.setdefault(id(p), [canonical_name(f"{prefix}.{f}" if prefix else f) for f in fqns])
        else:
            out.setdefault(id(p), [canonical_name(name)])
    return out


def _range(start: int, n: int) -> Any:
    def values(t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1)[start:start + n]
    return values


def gather_in(units: list[Any], dtypes: dict[int, torch.dtype], group: Any,
              world: int) -> dict[int, torch.nn.Parameter] | None:
    """id(original parameter) -> its full value in the units' compute dtype (``dtypes``, by module;
    a unit absent from it computes in its stored dtype), from one all-gather of every unit's shard;
    None where that layout does not hold (use_orig_params=False, NO_SHARD, units computing in
    different dtypes, shards on different devices)."""
    flats = [u._handle.flat_param for u in units]
    if (not flats or world < 2
            or any(f._params is None or not u._handle.uses_sharded_strategy
                   for u, f in zip(units, flats, strict=True))):
        return None
    shards = [local_shard(f) for f in flats]
    wanted = {dtypes.get(id(u._fsdp_wrapped_module), s.dtype) for u, s in zip(units, shards, strict=True)}
    if len(wanted) != 1 or len({s.device for s in shards}) != 1:
        return None
    dtype = wanted.pop()
    sizes = [s.numel() for s in shards]
    with torch.no_grad():
        send = torch.cat([s.reshape(-1).to(dtype) for s in shards])
        recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        all_gather_into(recv, send, group=group)
        by_rank = recv.view(world, send.numel())
        out: dict[int, torch.nn.Parameter] = {}
        start = 0
        for flat, size in zip(flats, sizes, strict=True):
            # A unit's unsharded flat parameter is its ranks' shards end to end; the originals
            # lie in it in order, with alignment padding between some of them.
            pieces = by_rank[:, start: start + size]
            start += size
            offset, originals = 0, iter(zip(flat._params, flat._shapes, strict=True))
            for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
                if not padding:
                    p, shape = next(originals)
                    full = _span(pieces, offset, numel).view(shape)
                    out[id(p)] = torch.nn.Parameter(full, requires_grad=p.requires_grad)
                offset += numel
    return out


def _span(pieces: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """Elements ``offset:offset + numel`` of the rows of ``pieces`` laid end to end: a view into the
    gathered buffer when they lie in one rank's row (most parameters), else a copy of the pieces."""
    size = pieces.shape[1]
    if numel == 0:
        return pieces[0, :0]
    first, last = offset // size, (offset + numel - 1) // size
    if first == last:
        return pieces[first, offset - first * size: offset - first * size + numel]
    parts = [pieces[k, max(offset - k * size, 0): min(offset + numel - k * size, size)] for k in range(first, last + 1)]
    return torch.cat(parts)


def full_from_shards(flat: Any, names: dict[int, list[str]], group: Any, world: int,
                     me: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One original parameter at a time, straight from the ranks' shards of a unit's flat
    parameter: each rank broadcasts its piece into the one full tensor that is yielded (summoning
    the unit would cost the whole unit)."""
    infos = flat._shard_param_infos
    local = [(i.intra_param_start_idx, i.intra_param_end_idx) if i.in_shard else None for i in infos]
    pieces: list[Any] = [None] * world
    dist.all_gather_object(pieces, local, group=group)
    shard = flat._local_shard
    with torch.no_grad():
        for idx, (p, shape) in enumerate(zip(flat._params, flat._shapes, strict=True)):
            full = torch.empty(shape.numel(), dtype=shard.dtype, device=shard.device)
            for k in range(world):
                rng = pieces[k][idx]
                if rng is None:
                    continue
                view = full[rng[0]: rng[1] + 1]
                if k == me:
                    info = infos[idx]
                    view.copy_(shard[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard])
                dist.broadcast(view, dist.get_global_rank(group, k) if group is not None else k, group=group)
            out = full.view(shape)
            for n in names.get(id(p), []):
                yield n, out
