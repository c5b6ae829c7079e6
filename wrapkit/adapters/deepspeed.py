"""DeepSpeed's ``DeepSpeedEngine`` at ZeRO stage 0-3.

``engine.config`` is DeepSpeed's own config dict, not the model's: the trap behind
failure #1. Under ZeRO-3 each parameter is an empty placeholder whose full size
is recorded in ``ds_numel`` / ``ds_shape``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._imports import is_instance
from ._base import Adapter


class DeepSpeedAdapter(Adapter):
    name = "deepspeed"
    distributed = True

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "deepspeed.runtime.engine", "DeepSpeedEngine")

    def _engine(self) -> Any:
        return self._backend_obj

    def _process_group(self) -> Any:
        return getattr(self._engine(), "data_parallel_group", None)

    @property
    def device(self) -> torch.device:
        dev = getattr(self._engine(), "device", None)
        if isinstance(dev, torch.device):
            return dev
        if isinstance(dev, (str, int)):
            return torch.device(dev)
        return super().device

    @property
    def zero_stage(self) -> int | None:
        engine = self._engine()
        fn = getattr(engine, "zero_optimization_stage", None)
        return int(fn()) if callable(fn) else 0

    @property
    def is_sharded(self) -> bool:
        return self.zero_stage == 3 and self.world_size > 1

    @property
    def world_size(self) -> int:
        return self._group_size_and_rank()[0]

    @property
    def rank(self) -> int:
        return self._group_size_and_rank()[1]

    def _global_numel(self, p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))
