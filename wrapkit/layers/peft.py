"""PEFT's ``PeftModel``: the base model with adapter layers injected in place.

Besides peeling the layer, this module holds what the rest of the package needs to
know about PEFT's injected layers: how to run the model with the adapters off
(``adapters_off``) and how its state-dict keys map to the base model's
(``base_key_map``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._imports import is_instance
from .._names import canonical_name
from ._layer import Layer

__all__ = ["PeftLayer", "adapters_off", "base_key_map", "merged_layers"]


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


@contextlib.contextmanager
def adapters_off(peft_model: torch.nn.Module) -> Iterator[None]:
    """Every adapter disabled inside; on exit the adapters and every ``requires_grad`` flag are
    as they were.

    PEFT's own ``disable_adapter()`` re-enables through ``set_adapter``, which marks the
    active adapters trainable (peft ``BaseTunerLayer.enable_adapters``): a frozen policy
    would come out with trainable LoRA weights. The flags are put back here."""
    model: Any = peft_model
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


def merged_layers(peft_model: torch.nn.Module) -> list[str]:
    """Names of the injected layers whose adapters are merged into the base weights (``merge_adapter()``):
    there the base weights are not the base model's, and disabling the adapters would unmerge them in place."""
    return [canonical_name(n) for n, m in peft_model.named_modules()
            if is_instance(m, "peft.tuners.tuners_utils", "BaseTunerLayer") and getattr(m, "merged", False)]


# The child of an injected layer that holds the base model's own weights.
_KEPT_CHILD = (("peft.tuners.tuners_utils", "BaseTunerLayer", "base_layer"),
               ("peft.utils.other", "ModulesToSaveWrapper", "original_module"))


def base_key_map(peft_model: torch.nn.Module) -> Callable[[str], str | None]:
    """Canonical key of ``peft_model``'s state dict -> the base model's own key, or ``None``
    for an adapter's tensor (LoRA matrices, ``modules_to_save`` copies, prompt encoders).

    ``q_proj.base_layer.weight`` becomes ``q_proj.weight``, the ``base_model.model.`` prefix
    goes, and nested injected layers are unfolded from the inside out."""
    model: Any = peft_model
    base = model.get_base_model()
    prefix = next(canonical_name(n) for n, m in peft_model.named_modules() if m is base)
    kept: dict[str, str] = {}
    for name, mod in peft_model.named_modules():
        for module_name, cls_name, child in _KEPT_CHILD:
            if is_instance(mod, module_name, cls_name):
                kept[canonical_name(name)] = child
                break
    # Longest first: the innermost of nested injected layers is unfolded first.
    layers = sorted(kept, key=len, reverse=True)
    head = prefix + "." if prefix else ""

    def rename(key: str) -> str | None:
        for layer in layers:  # each at most once, inner before outer
            if not key.startswith(layer + "."):
                continue
            rest, child = key[len(layer) + 1:], kept[layer] + "."
            if not rest.startswith(child):
                return None  # an adapter's own tensor
            key = f"{layer}.{rest[len(child):]}"
        return key[len(head):] if key.startswith(head) else None

    return rename
