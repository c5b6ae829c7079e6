"""A bare ``nn.Module``: no wrapper, parameters wherever they are."""

from __future__ import annotations

from ._base import Adapter


class PlainAdapter(Adapter):
    name = "plain"
