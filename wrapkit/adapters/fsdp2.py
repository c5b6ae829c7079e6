"""FSDP2 (``fully_shard``): no wrapper object; the module's class becomes an ``FSDPModule``
subclass and its parameters become ``DTensor`` shards over a device mesh."""

from __future__ import annotations

from typing import Any

import torch

from .._imports import is_instance
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

    def _mesh(self) -> Any:
        for p in self._innermost.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
        return None

    def _process_group(self) -> Any:
        mesh = self._mesh()
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
        mesh = self._mesh()
        if mesh is not None and mesh.device_type != "cpu":
            mod = getattr(torch, mesh.device_type)
            return torch.device(mesh.device_type, mod.current_device())
        return torch.device("cpu")

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    @property
    def world_size(self) -> int:
        return self._group_size_and_rank()[0]

    @property
    def rank(self) -> int:
        return self._group_size_and_rank()[1]

    def _global_numel(self, p: torch.Tensor) -> int:
        # A DTensor reports its global shape; its local shard is ``p.to_local()``.
        return p.numel()
