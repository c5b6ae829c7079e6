"""``torch.compile`` wraps a module in ``OptimizedModule``; the original sits in ``_orig_mod``."""

from __future__ import annotations

import torch

from .._imports import is_instance
from ._layer import Layer


class CompileLayer(Layer):
    name = "compile"

    @classmethod
    def matches(cls, obj: object) -> bool:
        # torch._dynamo is imported by the first torch.compile call, not by ``import torch``.
        return is_instance(obj, "torch._dynamo.eval_frame", "OptimizedModule")

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        inner = obj._orig_mod
        assert isinstance(inner, torch.nn.Module)
        return inner
