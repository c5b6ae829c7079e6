"""``DistributedDataParallel``: one full replica per rank, gradients all-reduced."""

from __future__ import annotations

import torch

from .._imports import is_instance
from ._base import ReplicatedAdapter


class DDPAdapter(ReplicatedAdapter):
    name = "ddp"
    distributed = True

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
