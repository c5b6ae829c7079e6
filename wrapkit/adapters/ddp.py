"""``DistributedDataParallel``: one full replica per rank, gradients all-reduced."""

from __future__ import annotations

from typing import Any

import torch

from .._imports import is_instance
from ._base import Adapter


class DDPAdapter(Adapter):
    name = "ddp"
    distributed = True

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.nn.parallel.distributed", "DistributedDataParallel")

    def _process_group(self) -> Any:
        return getattr(self._backend_obj, "process_group", None)

    @property
    def device(self) -> torch.device:
        ids = getattr(self._backend_obj, "device_ids", None)
        if ids:
            dev = ids[0]
            return dev if isinstance(dev, torch.device) else torch.device("cuda", dev)
        return super().device

    @property
    def world_size(self) -> int:
        return self._group_size_and_rank()[0]

    @property
    def rank(self) -> int:
        return self._group_size_and_rank()[1]
