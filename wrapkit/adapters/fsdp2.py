"""FSDP2 (``fully_shard``): no wrapper object; the module's class becomes an ``FSDPModule``
subclass and its parameters become ``DTensor`` shards over a device mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._agree import settle
from .._imports import is_instance, lookup
from .._names import canonical_name
from ._base import Adapter


class FSDP2Adapter(Adapter):
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

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
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

    # -- full parameters (gathered / generation / named_full_parameters) --------------
    def gather_bypass(self) -> bool:
        return True

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
        group = self.process_group()
        copies: dict[int, tuple[Any, torch.nn.Parameter]] = {}
        for p, full in _all_full(list(self._unique_parameters())):
            copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))

        def replace(mod: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor | None:
            if id(p) not in copies:
                full = self.gather_one(p)
                if full is p or full.data_ptr() == p.data_ptr():
                    return None
                copies[id(p)] = (p, torch.nn.Parameter(full, requires_grad=p.requires_grad))
            return copies[id(p)][1]

        def finish(failed: bool) -> None:
            if modifier_rank is None or failed:
                return  # the copies are dropped: the shards were never touched
            from torch.distributed.tensor import distribute_tensor

            src = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
            with torch.no_grad():
                for p, full in copies.values():
                    local = distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=src)
                    p.to_local().copy_(local.to_local())
            self.weights_written()

        with settle(finish, modifier_rank is not None, group, self.world_size):
            yield replace

    # -- placement and freezing (place / to_eval_frozen) -------------------------------
    # Moving goes through ``nn.Module._apply``, which FSDP2 overrides to re-register
    # the padded local shards; only the check needs to look inside the DTensors.
    def placement_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in super().placement_tensors():
            local = getattr(t, "_local_tensor", None)
            yield (f"{name} (local shard)", local) if isinstance(local, torch.Tensor) else (name, t)


def _all_full(params: list[Any]) -> list[tuple[Any, torch.Tensor]]:
    """Full copies of every DTensor sharded as FSDP2 does (``Shard(0)`` on a 1-D mesh), in one all-gather.

    One collective instead of one per parameter: on small models the per-call latency,
    not the bytes, dominates. Other layouts are left to ``full_tensor()`` one by one.
    """
    from torch.distributed.tensor import DTensor, Shard

    todo = [p for p in params if isinstance(p, DTensor) and p.device_mesh.ndim == 1
            and tuple(p.placements) == (Shard(0),) and p.dim() > 0]
    if not todo:
        return []
    mesh, dtype, device = todo[0].device_mesh, todo[0].dtype, todo[0].to_local().device
    todo = [p for p in todo if p.device_mesh == mesh and p.dtype == dtype and p.to_local().device == device]
    world, me = mesh.size(), mesh.get_local_rank()
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
        dist.all_gather_into_tensor(recv, send, group=mesh.get_group(0))
        out, offset = [], 0
        for p, (size, counts) in zip(todo, layout, strict=True):
            pieces = [recv[k * total + offset: k * total + offset + counts[k]] for k in range(world)]
            out.append((p, torch.cat(pieces).view(p.shape)))
            offset += size
    return out

