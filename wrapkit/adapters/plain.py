"""A bare ``nn.Module``: no wrapper, parameters wherever they are."""

from __future__ import annotations

import torch

from .core.base import Adapter
from .core.parts import Parts
from .core.recipes import Recipe, Setting, whole
from .core.whole import WholeLikeness, whole_parts


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    return whole(model, setting)


class PlainAdapter(Adapter):
    name = "plain"
    recipe = Recipe(("plain",), _build, order=0)

    def parts(self) -> Parts:
        # A copy starts from the module as the user handed it, compiled or not.
        return whole_parts(self).replace(likeness=WholeLikeness(self, start=lambda: self.module))
