from __future__ import annotations

from typing import ClassVar

import torch


class Layer:
    """A transparent layer around a model: detected by class, peeled to the module inside."""

    name: ClassVar[str]

    @classmethod
    def matches(cls, obj: object) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError
