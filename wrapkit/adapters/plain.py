"""A bare ``nn.Module``: no wrapper, parameters wherever they are."""

from __future__ import annotations

import torch

from ._base import Adapter


class PlainAdapter(Adapter):
    name = "plain"

    def bare_frozen(self) -> torch.nn.Module | None:
        # The module as the user handed it, compiled or not.
        return self.module
