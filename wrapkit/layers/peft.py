"""PEFT's ``PeftModel``: the base model with adapter layers injected in place."""

from __future__ import annotations

from typing import Any

import torch

from .._imports import is_instance
from ._layer import Layer


class PeftLayer(Layer):
    name = "peft"

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "peft.peft_model", "PeftModel")

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        peft_model: Any = obj
        inner = peft_model.get_base_model()
        assert isinstance(inner, torch.nn.Module)
        return inner
