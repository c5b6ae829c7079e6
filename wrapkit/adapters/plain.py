"""A bare ``nn.Module``: no wrapper, parameters wherever they are."""

from __future__ import annotations

import torch

from ._base import Adapter
from ._recipes import Recipe, Setting, whole


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    return whole(model, setting)


class PlainAdapter(Adapter):
    name = "plain"
    recipe = Recipe(("plain",), _build, order=0)

    def bare_frozen(self) -> torch.nn.Module | None:
        # The module as the user handed it, compiled or not.
        return self.module
