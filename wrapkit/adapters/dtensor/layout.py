"""DTensor parameters, whatever placed them (``fully_shard``, ``parallelize_module``, a ``tp_plan``):
their layout on the mesh, full values gathered with one collective per group of parameters split over
the same mesh dimensions, full values written back, this rank's pieces for a load, and the keys that
say two shards hold the same slice.

``Shard(d)`` on any tensor dimension, ``Replicate`` on any mesh dimension, and the even
``_StridedShard`` FSDP2 leaves beside tensor parallelism are read here directly; any other placement
(``Partial``, an uneven strided split) through DTensor's own ``full_tensor()``, one parameter at a time.
DTensor splits a dimension as ``torch.chunk`` does, mesh dimension by mesh dimension in order (a
strided one after those it names); every rank's block, its shape and offset, follows from its mesh
coordinates, so one all-gather brings them all and each value is put together from them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..._agree import settle
from ..._errors import UnsupportedModelError
from ..._gather import Replace, all_gather_into
from ..._imports import lookup
from ..core.internals import DEVICE_MESH, require_internals
from ..core.parts import local_tensor
from ..core.topology import Topology

__all__ = ["TP_HOOKS", "Layout", "is_dtensor", "mesh_key", "shard_key", "full_values", "full_value", "write_full",
           "refuse_tp_adapters", "flat_group", "readable", "gather_many", "full_copies", "mesh_device"]

Shape = tuple[int, ...]

# Where tensor parallelism's input and output redistribution lives: torch's distribute_module puts it
# in forward hooks, transformers' tensor parallelism (``tp_plan``) replaces each layer's ``forward``.
TP_HOOKS = ("torch.distributed.tensor.", "transformers.distributed.tensor_parallel.")


class Layout(NamedTuple):
    """Where a DTensor parameter lies: its ``mesh``, the mesh dimensions that split it
    (``shard_dims``: ranks along them hold different slices) and those that hold copies of the
    same values (``replica_dims``). FSDP2 alone: one shard dimension, the last, and under HSDP a
    replica dimension before it."""

    mesh: Any
    shard_dims: tuple[int, ...]
    replica_dims: tuple[int, ...]

    @classmethod
    def of(cls, p: Any) -> Layout:
        places = tuple(p.placements)
        shard = tuple(i for i, x in enumerate(places) if _splits(x))
        return cls(p.device_mesh, shard, tuple(i for i in range(len(places)) if i not in shard))

    def shard_group(self) -> Any:
        """The group across the slices of one copy: every rank that holds a different one (``flat_group``);
        None where no mesh dimension splits the parameter."""
        return flat_group(self.mesh, self.shard_dims) if self.shard_dims else None

    def replica_groups(self) -> list[Any]:
        """The group of each replica dimension: across the copies."""
        return [self.mesh.get_group(d) for d in self.replica_dims]


def is_dtensor(t: object) -> bool:
    dtensor = lookup("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()))


def shard_key(p: Any, local: torch.Tensor, meshes: dict[int, tuple[Any, ...]]) -> tuple[Any, ...]:
    """What two DTensors must share for their local shards to be the same slice; ``meshes`` caches
    each mesh's key (reading a mesh's rank layout is slow)."""
    mesh = p.device_mesh
    if id(mesh) not in meshes:
        meshes[id(mesh)] = mesh_key(mesh)
    return ("dtensor", meshes[id(mesh)], tuple(str(x) for x in p.placements), tuple(p.shape), tuple(local.shape))


def _splits(x: Any) -> bool:
    """Whether placement ``x`` splits a tensor dimension (``_StridedShard`` is no ``Shard`` to torch)."""
    return bool(x.is_shard()) or type(x).__name__ == "_StridedShard"


def _split_order(p: Any) -> tuple[int, ...] | None:
    """The mesh dimensions that split ``p``, in the order they cut it; None for a layout not read here
    (``Partial``, a custom placement, an uneven strided split). DTensor cuts mesh dimension by mesh
    dimension in order, except that a ``_StridedShard`` dimension cuts after the later ones splitting
    the same tensor dimension, whose sizes its split factor multiplies (FSDP2 beside tensor parallelism:
    tp's slices first, then dp's slice of each)."""
    from torch.distributed.tensor import Replicate, Shard

    places = list(p.placements)
    order = [i for i, x in enumerate(places) if type(x) is Shard]
    if any(type(x) not in (Shard, Replicate) and not _splits(x) for x in places):
        return None
    for i, x in enumerate(places):
        if type(x) in (Shard, Replicate):
            continue
        d = x.dim % p.dim()
        later = [j for j in order if j > i and places[j].dim % p.dim() == d]
        factor = getattr(x, "split_factor", 0)
        # Even splits only: there, slices of slices are what every maker of this placement means.
        if not later or math.prod(p.device_mesh.size(j) for j in later) != factor or (
                p.shape[d] % (factor * p.device_mesh.size(i))):
            return None
        order.insert(order.index(later[-1]) + 1, i)
    return tuple(order)


def readable(p: Any) -> bool:
    """Whether ``p``'s layout is read here directly: ``Shard`` and ``Replicate``, and ``_StridedShard``
    split evenly as FSDP2 splits a tensor-parallel slice."""
    return p.dim() > 0 and _split_order(p) is not None


def chunk_sizes(size: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk`` cuts ``size`` into over ``parts`` ranks: ceil(size / parts) each
    while it lasts, so the last ranks may hold less or nothing."""
    chunk = -(-size // parts) if parts else 0
    return [max(0, min(chunk, size - k * chunk)) for k in range(parts)]


def _block(p: Any, coords: list[int], cuts: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The shape and offset of the block of ``p`` that the rank at mesh coordinates ``coords`` holds once
    mesh dimensions ``cuts`` have split it, in that order (each cut chunks the block the earlier left)."""
    shape, offset = list(p.shape), [0] * p.dim()
    for dim in cuts:
        d = p.placements[dim].dim % p.dim()
        sizes = chunk_sizes(shape[d], p.device_mesh.size(dim))
        offset[d] += sum(sizes[: coords[dim]])
        shape[d] = sizes[coords[dim]]
    return shape, offset


def full_values(params: list[Any], dtypes: dict[int, torch.dtype]) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(parameter, full value)`` for each DTensor of ``params`` whose layout is read here (``readable``),
    in ``dtypes[id(p)]`` (default: its own dtype); the others are not yielded (``full_value`` serves
    them). Parameters on one mesh, in one dtype and device, and split over the same mesh dimensions are
    gathered together, in one all-gather over those dimensions' ranks, whatever tensor dimension and
    order each is cut in. Casting before the gather, as FSDP2 does, makes the values exactly those its
    forward computes with, and bf16 halves the bytes. One collective instead of one per parameter: on
    small models the per-call latency, not the bytes, dominates. Each value is built as it is reached:
    a consumer that packs each away holds one at a time."""
    groups: dict[tuple[Any, ...], list[tuple[Any, tuple[int, ...]]]] = {}
    meshes: dict[int, tuple[tuple[Any, ...], list[int]]] = {}
    for p in params:
        if not is_dtensor(p) or not readable(p):
            continue
        mesh = p.device_mesh
        if id(mesh) not in meshes:
            meshes[id(mesh)] = (mesh_key(mesh), [mesh.get_local_rank(i) for i in range(mesh.ndim)])
        key_of_mesh, coords = meshes[id(mesh)]
        local = local_tensor(p)
        order = _split_order(p)
        assert order is not None  # readable
        if list(local.shape) != _block(p, coords, order)[0]:
            continue  # not split as torch.chunk splits (padded storage): DTensor's own gather
        key = (key_of_mesh, dtypes.get(id(p), p.dtype), local.device, tuple(sorted(order)))
        groups.setdefault(key, []).append((p, order))
    for (_, dtype, device, dims), split in groups.items():
        yield from _gather_group(split, dims, dtype, device)


def _gather_group(split: list[tuple[Any, tuple[int, ...]]], dims: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[Any, torch.Tensor]]:
    """Full values of the parameters of ``split``, each cut over mesh dimensions ``dims`` in its own
    order (given beside it) and along its own tensor dimensions: one all-gather over the ranks along
    ``dims`` (``flat_group``: rank ``k`` there is the ``k``-th coordinate, row-major over them), then
    each value put together from every rank's block."""
    todo = [p for p, _ in split]
    mesh = todo[0].device_mesh
    with torch.no_grad():
        locals_ = [local_tensor(p).to(dtype) for p in todo]
    if not dims:  # replicated on every dimension: the local tensor is the whole
        for p, value in zip(todo, locals_, strict=True):
            yield p, value.clone() if value is local_tensor(p) else value
        return
    sizes = [mesh.size(d) for d in dims]
    everyone: list[list[int]] = []  # each rank's mesh coordinates (0 along the dimensions not in ``dims``)
    for k in range(math.prod(sizes)):
        coords = [0] * mesh.ndim
        for d, n in zip(reversed(dims), reversed(sizes), strict=True):
            coords[d], k = k % n, k // n
        everyone.append(coords)
    # Every rank's block of each parameter; the first rank's is the largest (each cut's first chunk is).
    blocks = [[_block(p, coords, order) for coords in everyone] for p, order in split]
    slots = [max(math.prod(shape) for shape, _ in per_rank) for per_rank in blocks]
    total = sum(slots)
    with torch.no_grad():
        send = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for value, slot in zip(locals_, slots, strict=True):
            send[offset: offset + value.numel()].copy_(value.reshape(-1))
            offset += slot
        del locals_
        recv = torch.empty(len(everyone) * total, dtype=dtype, device=device)
        all_gather_into(recv, send, group=flat_group(mesh, dims))
        del send
    start = 0
    for p, per_rank, slot in zip(todo, blocks, slots, strict=True):
        with torch.no_grad():
            full = torch.empty(tuple(p.shape), dtype=dtype, device=device)
            for k, (shape, offset_) in enumerate(per_rank):
                where = tuple(slice(o, o + n) for o, n in zip(offset_, shape, strict=True))
                full[where] = recv[k * total + start: k * total + start + math.prod(shape)].view(shape)
        start += slot
        yield p, full


def full_value(p: torch.Tensor) -> torch.Tensor:
    """The full value of one DTensor, any placement (DTensor's own collective), or a plain tensor detached."""
    if is_dtensor(p):
        with torch.no_grad():
            full: torch.Tensor = p.full_tensor()  # type: ignore[attr-defined]
        return full
    return p.detach()


def write_full(p: Any, full: torch.Tensor, modifier_rank: int, group: Any, replicas: Iterable[Any]) -> None:
    """Put ``full``, as rank ``modifier_rank`` of ``group`` (the ranks holding one copy of the model) holds
    it, into DTensor ``p``'s shard on every rank; then each shard of the first copy goes to every copy
    (``replicas``: the groups across the copies), so the copies stay equal whatever each one's writer wrote."""
    from torch.distributed.tensor import distribute_tensor

    full = full.contiguous()
    src = modifier_rank if group is None else dist.get_global_rank(group, modifier_rank)
    dist.broadcast(full, src, group=group)
    # Every rank of a copy now holds the same full tensor: each cuts out its own shard, no communication
    # (DTensor's own cut, so any placement it makes, ``_StridedShard`` included, is cut as it was made).
    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local().contiguous()
    for replica_group in replicas:
        dist.broadcast(local, dist.get_global_rank(replica_group, 0), group=replica_group)
    p.to_local().copy_(local)


def refuse_tp_adapters(stack: tuple[str, ...]) -> None:
    """PEFT's layers on a tensor-parallel model: refused, naming why. PEFT sizes each rank's LoRA matrices
    to that rank's slice of the layer (``lora_B`` of a column-split ``q_proj`` has half its rows on two
    ranks) and keeps them as plain tensors, a split no DTensor placement records: their full values could
    be neither read nor written, and a gathered model would run the wrong adapters."""
    if "peft" in stack:
        raise UnsupportedModelError(
            f"{' > '.join(stack)}: PEFT adapters on a tensor-parallel model are not supported. PEFT gives each "
            "rank adapter matrices sized to its own slice of the layer, as plain tensors that no DTensor "
            "placement describes, so their full values can be neither read nor written. Train LoRA under FSDP2, "
            "FSDP1 or DeepSpeed without tensor parallelism, or merge the adapters before parallelizing.")


def flat_group(mesh: Any, dims: tuple[int, ...]) -> Any:
    """The process group across mesh dimensions ``dims`` (ranks in row-major order over them); None
    for the default group. Several dimensions need a flattened mesh: torch makes one, a collective
    over every rank of the job, so this runs where every rank does (``adapt()``), and torch keeps it."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    if tuple(dims) == tuple(range(mesh.ndim)) and mesh.mesh.flatten().tolist() == list(
            range(dist.get_world_size())):
        return None  # the whole job, in order
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise UnsupportedModelError(
            f"the parameters lie on a {mesh.ndim}-D device mesh without dimension names, split over "
            f"{len(dims)} of its dimensions; name them (init_device_mesh(..., mesh_dim_names=...)) so that the "
            "ranks holding one copy of the model can be given a group of their own.")
    sub = mesh[tuple(names[d] for d in dims)]
    require_internals([sub], DEVICE_MESH, "device mesh", "torch")
    return sub._flatten().get_group()
















def mesh_device(mesh: Any) -> torch.device | None:
    """The device this rank computes on for ``mesh``: its accelerator's current one; None on the CPU."""
    if mesh is None or mesh.device_type == "cpu":
        return None
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())




def gather_many(params: list[Any]) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(parameter, full value)`` for ``params``: the readable DTensors together (``full_values``), then
    the rest (plain tensors, other placements) one by one."""
    served: set[int] = set()
    for p, full in full_values(params, {}):
        served.add(id(p))
        yield p, full
    for p in params:
        if id(p) not in served:
            yield p, full_value(p)


@contextlib.contextmanager
def full_copies(params: list[Any], dtypes: dict[int, torch.dtype], modifier_rank: int | None,
                topology: Topology, world_size: int, written: Callable[[], None]) -> Iterator[Replace]:
    """Full copies of the DTensor ``params`` (in ``dtypes[id(p)]`` where given), for ``bypassed`` to
    swap in; with ``modifier_rank``, on normal exit on every rank, the writer's copies go back into
    every shard (``write_full``) and ``written()`` runs. The shards are never touched otherwise."""
    copies: dict[int, tuple[Any, torch.nn.Parameter]] = {}
    for p, full in list(full_values(params, dtypes)):
        copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))

    def replace(mod: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor | None:
        if id(p) not in copies:
            full = full_value(p)
            if full is p or full.data_ptr() == p.data_ptr():
                return None  # a plain tensor: already whole
            full = full.to(dtypes.get(id(p), full.dtype))
            copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))
        return copies[id(p)][1]

    def finish(failed: bool) -> None:
        if modifier_rank is None or failed:
            return  # the copies are dropped: the shards were never touched
        with torch.no_grad():
            for p, full in copies.values():
                write_full(p, full.detach(), modifier_rank, topology.group, topology.replicas)
        written()

    with settle(finish, modifier_rank is not None, topology.group, world_size, topology.replicas):
        yield replace
