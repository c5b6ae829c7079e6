"""``DistributedDataParallel``: one full replica per rank, gradients all-reduced."""

from __future__ import annotations

import torch

from .._imports import is_instance
from .core.kinds import ReplicatedAdapter
from .core.recipes import Recipe, Setting, halves, whole


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = setting.device
    group = halves()[0] if setting.topology == "subgroup" else None
    return DistributedDataParallel(whole(model, setting), device_ids=[device] if device.type == "cuda" else None,
                                   process_group=group)


class DDPAdapter(ReplicatedAdapter):
    name = "ddp"
    distributed = True
    recipe = Recipe(("ddp",), _build, order=2, topologies=frozenset({"subgroup"}))

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.nn.parallel.distributed", "DistributedDataParallel")

    @property
    def device(self) -> torch.device:
        ids = getattr(self._backend_obj, "device_ids", None)
        if ids:
            dev = ids[0]
            return dev if isinstance(dev, torch.device) else torch.device("cuda", dev)
        return super().device
