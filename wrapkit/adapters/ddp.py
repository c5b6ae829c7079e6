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

    # -- placement and freezing (place / to_eval_frozen) -------------------------------
    def to_eval_frozen(self) -> Adapter:
        # A replicated wrapper only exists to average gradients (DDP refuses a model with
        # none to average), so the frozen model is the module inside it, on the same device.
        from .._registry import adapt

        assert self._backend_obj is not None
        inner: Adapter = adapt(self.inner(self._backend_obj))
        inner.place(self.device)
        return inner.to_eval_frozen()
