"""``torch.nn.DataParallel``: single process, replicated per forward over ``device_ids``."""

from __future__ import annotations

import torch

from .core.kinds import ReplicatedAdapter
from .core.recipes import Recipe, Setting, whole


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    return torch.nn.DataParallel(whole(model, setting))


class DataParallelAdapter(ReplicatedAdapter):
    name = "dp"
    recipe = Recipe(("dp",), _build, order=1)

    @classmethod
    def matches(cls, obj: object) -> bool:
        # DataParallel is always importable with torch; no optional library involved.
        return isinstance(obj, torch.nn.DataParallel)

    @property
    def device(self) -> torch.device:
        # Inputs go to device_ids[0]; on a machine without GPUs the list is empty
        # and DataParallel simply calls the module where it is.
        ids = getattr(self._backend_obj, "device_ids", None)
        if ids:
            src = getattr(self._backend_obj, "src_device_obj", None)
            return src if isinstance(src, torch.device) else torch.device("cuda", int(ids[0]))
        return super().device
