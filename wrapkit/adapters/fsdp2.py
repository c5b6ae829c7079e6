"""FSDP2 (``fully_shard``): no wrapper object; the module's class becomes an ``FSDPModule``
subclass and its parameters become ``DTensor`` shards over a device mesh."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._agree import settle
from .._gather import Bypass, all_gather_into, submodules
from .._imports import is_instance, lookup
from .._names import canonical_name
from ._base import Adapter, ShardedAdapter, copy_into
from ._internals import DTENSOR, FSDP2_MODULE, FSDP2_STATE, require_internals
from ._primitives import Piece


class FSDP2Adapter(ShardedAdapter):
    name = "fsdp2"
    peels = False
    distributed = True

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.distributed.fsdp", "FSDPModule")

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        return obj

    def mesh(self) -> Any:
        # FSDP2's own record first: inside gathered() the module holds plain full copies, and
        # a mesh read off the parameters would be gone (and rank/world_size with it).
        for _, state in self._fsdp_states():
            for group in getattr(state, "_fsdp_param_groups", ()):
                mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
                if mesh is not None:
                    return mesh
        for p in self._innermost.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
        return None

    def process_group(self) -> Any:
        mesh = self.mesh()
        if mesh is None:
            return None
        # The shard dimension is the last one (HSDP puts replication first).
        return mesh.get_group(mesh.ndim - 1)

    def replica_groups(self) -> list[Any]:
        mesh = self.mesh()
        return [] if mesh is None else [mesh.get_group(d) for d in range(mesh.ndim - 1)]

    def _check_internals(self) -> None:
        fsdp_module = lookup("torch.distributed.fsdp", "FSDPModule")
        modules = [m for m in self.module.modules() if fsdp_module is not None and isinstance(m, fsdp_module)]
        require_internals(modules, FSDP2_MODULE, "fully_shard modules", "torch")
        require_internals([state for _, state in self._fsdp_states()], FSDP2_STATE, "FSDP states", "torch")
        dtensor = lookup("torch.distributed.tensor", "DTensor")
        shards = [p for p in self._innermost.parameters() if dtensor is not None and isinstance(p, dtensor)]
        require_internals(shards, DTENSOR, "DTensor parameters", "torch")

    def unsupported_dtensor(self, p: Any) -> str | None:
        # fully_shard's own layout: shards and replicas over the mesh it was given. A parameter on
        # a mesh with more dimensions (FSDP2 over one dimension of a (dp, tp) mesh, tensor parallel
        # over the other) or placed otherwise (_StridedShard, Partial) is beyond every read and write here.
        mesh = self.mesh()
        own = p.device_mesh
        if mesh is None or _mesh_key(own) != _mesh_key(mesh):
            return (f"fully_shard was given a {getattr(mesh, 'ndim', 0)}-D mesh, and a parameter on another mesh "
                    "(a tensor-parallel dimension beside the data-parallel ones) is a layout the fsdp2 adapter "
                    "cannot read")
        from torch.distributed.tensor import Replicate, Shard

        if not all(type(x) in (Shard, Replicate) for x in p.placements):
            return "placements other than Shard and Replicate are a layout the fsdp2 adapter cannot read"
        return None

    def _fsdp_states(self) -> Iterator[tuple[Any, Any]]:
        """(module, its FSDP state) for every module ``fully_shard`` was applied to."""
        fsdp_module = lookup("torch.distributed.fsdp", "FSDPModule")
        for m in self.module.modules():
            if fsdp_module is not None and isinstance(m, fsdp_module):
                fsdp: Any = m
                yield fsdp, fsdp._get_fsdp_state()

    @staticmethod
    def _compute_dtypes(states: list[tuple[Any, Any]]) -> dict[int, torch.dtype]:
        """id(sharded parameter) -> the ``param_dtype`` of its ``MixedPrecisionPolicy``, where
        that is not its own dtype: what FSDP2 all-gathers it in and computes with."""
        out: dict[int, torch.dtype] = {}
        for _, state in states:
            for group in getattr(state, "_fsdp_param_groups", ()):
                dtype = group.mp_policy.param_dtype
                for fsdp_param in group.fsdp_params:
                    p = fsdp_param.sharded_param
                    if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                        out[id(p)] = dtype
        return out

    @property
    def device(self) -> torch.device:
        state: Any = None
        get_state = getattr(self._backend_obj, "_get_fsdp_state", None)
        if get_state is not None:
            state = get_state()
        dev = getattr(state, "_device", None)
        if isinstance(dev, torch.device):
            return dev
        mesh = self.mesh()
        if mesh is not None and mesh.device_type != "cpu":
            mod = getattr(torch, mesh.device_type)
            return torch.device(mesh.device_type, mod.current_device())
        return torch.device("cpu")

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    def global_numel(self, p: torch.Tensor) -> int:
        # A DTensor reports its global shape; its local shard is ``p.to_local()``.
        return p.numel()

    def resident_parameter_bytes(self) -> int:
        total = 0
        for p in self._unique_parameters():
            local = getattr(p, "_local_tensor", p)  # a DTensor's shard; a plain tensor is whole
            total += local.numel() * local.element_size()
        return total

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        # A DTensor parameter reports its full shape itself.
        return {}

    def move(self, target: torch.device, copy: bool) -> None:
        # A DTensor's ``to()`` moves its local shard and keeps its placements; FSDP2 reads the
        # sharded parameters afresh at its next all-gather.
        Adapter.move(self, target, copy)

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        self._reshard()
        out: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {}
        meshes: dict[int, tuple[Any, ...]] = {}  # reading a mesh's rank layout is slow: once per mesh
        for name, p in self.unwrap().named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:  # not sharded by fully_shard: the whole tensor lives on every rank
                out[canonical_name(name)] = (p.data, ("full", tuple(p.shape)))
                continue
            if id(mesh) not in meshes:
                meshes[id(mesh)] = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape))
            # DTensor keeps its shard in ``_local_tensor``; ``to_local()`` returns the same
            # storage through an autograd function, ~30 us a call that a frequent sync repeats.
            local = getattr(p, "_local_tensor", None)
            if not isinstance(local, torch.Tensor):
                local = p.to_local()  # type: ignore[attr-defined]
            key = ("dtensor", meshes[id(mesh)], tuple(str(x) for x in getattr(p, "placements", ())),
                   tuple(p.shape), tuple(local.shape))
            out[canonical_name(name)] = (local, key)
        return out

    def layout_tensors(self) -> list[torch.Tensor] | None:
        # Straight from each module's dicts: ``parameters()`` and ``buffers()`` cost several times more.
        out: list[torch.Tensor] = []
        for m in submodules(self.unwrap()):
            for p in m._parameters.values():
                if p is not None:
                    local = getattr(p, "_local_tensor", None)
                    out.append(local if isinstance(local, torch.Tensor) else p)
            out.extend(b for b in m._buffers.values() if b is not None)
        return out

    # -- full parameters (gathered / generation / named_full_parameters) --------------
    def gather_bypass(self) -> Bypass:
        # FSDP2's pre/post-forward hooks on every fully_shard module, and the method wrappers of
        # register_fsdp_forward_method, live in torch.distributed.fsdp.
        return Bypass(("torch.distributed.fsdp.",))

    def gather_one(self, p: torch.Tensor) -> torch.Tensor:
        dtensor = lookup("torch.distributed.tensor", "DTensor")
        if dtensor is not None and isinstance(p, dtensor):
            with torch.no_grad():
                full: torch.Tensor = p.full_tensor()  # type: ignore[attr-defined]
            return full
        return p.detach()

    @contextlib.contextmanager
    def gather_full(self, modifier_rank: int | None) -> Iterator[Any]:
        # Full copies of the DTensor shards are swapped in by ``bypassed``; FSDP2's own
        # unshard/reshard state machine is never involved, so nothing of it needs restoring.
        # But FSDP2 leaves the root's parameters unsharded (and registered, in param_dtype)
        # after a forward that no backward follows: reshard first, so that every parameter
        # is a DTensor shard again and the copies all come from the same place.
        self._reshard()
        states = list(self._fsdp_states())
        group = self.process_group()
        # Reading, the copies are in the dtype FSDP2's forward computes in; writing
        # (modifier_rank), in the parameters' own dtype, so that the writes are kept exactly.
        dtypes = self._compute_dtypes(states) if modifier_rank is None else {}
        copies: dict[int, tuple[Any, torch.nn.Parameter]] = {}
        for p, full in _all_full(list(self._unique_parameters()), dtypes):
            copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))

        def replace(mod: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor | None:
            if id(p) not in copies:
                full = self.gather_one(p)
                if full is p or full.data_ptr() == p.data_ptr():
                    return None
                full = full.to(dtypes.get(id(p), full.dtype))
                copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))
            return copies[id(p)][1]

        def finish(failed: bool) -> None:
            if modifier_rank is None or failed:
                return  # the copies are dropped: the shards were never touched
            with torch.no_grad():
                for p, full in copies.values():
                    _write_back(p, full.detach(), modifier_rank)
            self.weights_written()

        # FSDP2's own casts of floating inputs (to param_dtype) and outputs (to output_dtype) are
        # hooks that ``bypassed`` takes out with the rest; the same casts go back in as hooks of ours.
        handles = [h for m, state in states for h in _cast_hooks(m, state)] if dtypes else []
        try:
            with settle(finish, modifier_rank is not None, group, self.world_size, self.replica_groups()):
                yield replace
        finally:
            for handle in handles:
                handle.remove()

    def _reshard(self) -> None:
        """Every unit back to its shards. After a forward that no backward followed, FSDP2 keeps
        the root's parameters unsharded: registered in their place are full copies in the
        compute dtype (rounded, under mixed precision), whose storage the next reshard frees.
        Every read and write of the weights starts from the shards, where the values live."""
        for m, _ in self._fsdp_states():
            m.reshard()

    def gather_each(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._reshard()
        yield from super().gather_each()

    def gather_units(self) -> list[list[torch.nn.Parameter]] | None:
        # Planned before anything is gathered, read after: the units must be the shards.
        self._reshard()
        return super().gather_units()

    def gather_many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        self._reshard()
        served: set[int] = set()
        for p, full in _each_full(params, {}):
            served.add(id(p))
            yield p, full
        for p in params:  # not sharded as FSDP2 shards (or another mesh or dtype): one by one
            if id(p) not in served:
                yield p, self.gather_one(p)

    def full_parameter_bytes(self) -> int:
        dtypes = self._compute_dtypes(list(self._fsdp_states()))
        return sum(p.numel() * dtypes.get(id(p), p.dtype).itemsize for p in self._unique_parameters())

    @contextlib.contextmanager
    def gather_layerwise(self) -> Iterator[None]:
        # ``fully_shard`` hooks every unit, the root included, so the module's own forward
        # gathers unit by unit. FSDP2 keeps the root (and a no-grad forward's last units)
        # unsharded after a forward; resharding on exit frees them, as before entry.
        try:
            yield
        finally:
            self._reshard()

    def load_pieces(self) -> list[Piece]:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self._reshard()  # write where the values come from
        out: list[Piece] = []
        for name, p in self.unwrap().named_parameters():
            local = getattr(p, "_local_tensor", None)
            full_shape = tuple(p.shape)
            if not isinstance(local, torch.Tensor):
                out.append(Piece(canonical_name(name), 0, p.numel(), full_shape, copy_into(p.data)))
                continue
            if local.numel() == 0:
                continue
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements)  # type: ignore[attr-defined]
            if tuple(shape[1:]) == full_shape[1:] and local.is_contiguous():
                # Rows ``offset[0]:`` of the full parameter: one contiguous range of it.
                row = math.prod(full_shape[1:])
                out.append(Piece(canonical_name(name), offset[0] * row, local.numel(), full_shape, copy_into(local)))
            else:  # sharded along another dimension: read the whole and take this rank's block
                block = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                out.append(Piece(canonical_name(name), 0, p.numel(), full_shape,
                                 _block_writer(local, full_shape, block)))
        return out

    # -- placement and freezing (place / to_eval_frozen) -------------------------------
    # Moving goes through ``nn.Module._apply``, which FSDP2 overrides to re-register
    # the padded local shards; only the check needs to look inside the DTensors.
    def placement_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in super().placement_tensors():
            local = getattr(t, "_local_tensor", None)
            yield (f"{name} (local shard)", local) if isinstance(local, torch.Tensor) else (name, t)


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()))


def _cast_hooks(module: torch.nn.Module, state: Any) -> list[Any]:
    """Hooks casting ``module``'s inputs and outputs as its ``MixedPrecisionPolicy`` says."""
    policy = getattr(state, "_mp_policy", None)
    handles = []
    if policy is not None and policy.cast_forward_inputs and policy.param_dtype is not None:
        def cast_inputs(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            return state._cast_forward_inputs(args, kwargs)
        handles.append(module.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if policy is not None and policy.output_dtype is not None:
        def cast_output(mod: torch.nn.Module, args: Any, output: Any) -> Any:
            return state._cast_output_dtype(output)
        handles.append(module.register_forward_hook(cast_output))
    return handles


def _write_back(p: Any, full: torch.Tensor, modifier_rank: int) -> None:
    """Put ``full``, as held by ``modifier_rank`` of the shard dimension, into DTensor ``p``'s shard
    on every rank. Over a 2-D mesh (HSDP) the first replica's values go to every replica, so
    the copies of the model stay equal whatever each replica's writer wrote."""
    from torch.distributed.tensor import distribute_tensor

    mesh = p.device_mesh
    shard_dim = mesh.ndim - 1
    group = mesh.get_group(shard_dim)
    full = full.contiguous()
    dist.broadcast(full, dist.get_global_rank(group, modifier_rank), group=group)
    # Every rank now holds the same full tensor: each cuts out its own shard, no communication.
    local = distribute_tensor(full, mesh, p.placements, src_data_rank=None).to_local().contiguous()
    for dim in range(shard_dim):
        replicas = mesh.get_group(dim)
        dist.broadcast(local, dist.get_global_rank(replicas, 0), group=replicas)
    p.to_local().copy_(local)


def _all_full(params: list[Any], dtypes: dict[int, torch.dtype]) -> list[tuple[Any, torch.Tensor]]:
    """``_each_full`` of ``params``, every value built."""
    return list(_each_full(params, dtypes))


def _each_full(params: list[Any], dtypes: dict[int, torch.dtype]) -> Iterator[tuple[Any, torch.Tensor]]:
    """Full copies of every DTensor sharded as FSDP2 does (``Shard(0)`` on the last mesh dimension,
    replicated on the others), in one all-gather over the shard dimension, each in
    ``dtypes[id(p)]`` (default: its own dtype). Casting before the gather, as FSDP2 does,
    makes the copies exactly the parameters its forward computes with, and bf16 halves the bytes.

    One collective instead of one per parameter: on small models the per-call latency,
    not the bytes, dominates. Other layouts are left to ``full_tensor()`` one by one.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def fsdp_layout(p: Any) -> bool:
        places = tuple(p.placements)
        return places[-1] == Shard(0) and all(x == Replicate() for x in places[:-1]) and p.dim() > 0

    todo = [p for p in params if isinstance(p, DTensor) and fsdp_layout(p)]
    if not todo:
        return

    def gather_dtype(p: Any) -> torch.dtype:
        own: torch.dtype = p.dtype
        return dtypes.get(id(p), own)

    mesh, dtype, device = todo[0].device_mesh, gather_dtype(todo[0]), todo[0].to_local().device
    todo = [p for p in todo if p.device_mesh == mesh and gather_dtype(p) == dtype and p.to_local().device == device]
    shard_dim = mesh.ndim - 1
    world, me = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    # torch.chunk semantics: every rank holds ceil(rows / world) rows but the last ones, maybe fewer or none.
    layout = []
    for p in todo:
        rows, per_row = p.shape[0], p.numel() // max(p.shape[0], 1)
        chunk = -(-rows // world)
        layout.append((chunk * per_row, [max(0, min(chunk, rows - k * chunk)) * per_row for k in range(world)]))
    total = sum(size for size, _ in layout)
    with torch.no_grad():
        send = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for p, (size, counts) in zip(todo, layout, strict=True):
            send[offset: offset + counts[me]].copy_(p.to_local().reshape(-1))
            offset += size
        recv = torch.empty(world * total, dtype=dtype, device=device)
        all_gather_into(recv, send, group=mesh.get_group(shard_dim))
    del send
    offset = 0
    for p, (size, counts) in zip(todo, layout, strict=True):
        # Built as it is reached: a consumer that packs each value away holds one at a time.
        with torch.no_grad():
            full = torch.cat([recv[k * total + offset: k * total + offset + counts[k]] for k in range(world)])
        offset += size
        yield p, full.view(p.shape)


def _block_writer(local: torch.Tensor, full_shape: tuple[int, ...], block: tuple[slice, ...]) -> Any:
    def write(values: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(values.reshape(full_shape)[block])
    return write
