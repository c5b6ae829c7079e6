"""PEFT's ``PeftModel``: the base model with adapter layers injected in place.

Besides peeling the layer, this module holds what the rest of the package needs to
know about PEFT's injected layers: how to run the model with the adapters off
(``adapters_off``) and how its state-dict keys map to the base model's
(``base_key_map``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .._errors import UnsupportedModelError
from .._imports import is_instance
from .._names import canonical_name
from ._layer import Layer

__all__ = ["PeftLayer", "adapters_off", "base_key_map", "merged_layers", "LoraFoldPlan", "fold_plan",
           "fold_state_dict", "lora_layer_keys", "lora_fold_stream"]


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


# -- LoRA folding: merged weights computed from the pieces, the live model left as it is ----------
class LoraFoldPlan:
    """What ``merge_adapters`` needs to know of the live PEFT model, read without touching it:
    how its keys map to the base model's, and the LoRA layers to fold."""

    def __init__(self, rename: Callable[[str], str | None], layers: list[tuple[str, Any]]) -> None:
        self.rename = rename
        self.layers = layers


def fold_plan(peft_root: torch.nn.Module) -> LoraFoldPlan:
    """What merging the LoRA adapters of ``peft_root`` (a PEFT model) needs; ``UnsupportedModelError``
    for layers that cannot be merged (the same on every rank: read off the module's structure)."""
    layers: list[tuple[str, Any]] = []
    problems: list[str] = []
    for mod_name, mod in peft_root.named_modules():
        if not is_instance(mod, "peft.tuners.tuners_utils", "BaseTunerLayer"):
            if is_instance(mod, "peft.utils.other", "ModulesToSaveWrapper"):
                problems.append(f"{canonical_name(mod_name)}: modules_to_save copies")
            continue
        name = canonical_name(mod_name)
        if not is_instance(mod, "peft.tuners.lora.layer", "Linear"):
            problems.append(f"{name}: {type(mod).__module__}.{type(mod).__name__}")
            continue
        for adapter in mod.active_adapters:
            # lora_bias appeared in PEFT 0.14; older layers have none.
            if mod.use_dora.get(adapter) or getattr(mod, "lora_bias", {}).get(adapter):
                problems.append(f"{name}: adapter {adapter!r} uses DoRA or a LoRA bias")
        layers.append((name, mod))
    if problems:
        raise UnsupportedModelError(
            "full_state_dict(merge_adapters=True) folds in LoRA adapters of Linear layers only; this model has "
            + "; ".join(problems)
            + ". Export with merge_adapters=False, or merge with PEFT's merge_and_unload() on an unsharded copy."
        )
    return LoraFoldPlan(base_key_map(peft_root), layers)


def _fold_keys(name: str, mod: Any) -> list[str]:
    """The entries a LoRA layer's merged weight is computed from: its base weight first."""
    keys = [f"{name}.base_layer.weight"]
    if not mod.merged and not mod.disable_adapters:
        for adapter in mod.active_adapters:
            if adapter in mod.lora_A:
                keys += [f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"]
    return keys


def _folded(mod: Any, keys: list[str], sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``W + sum(scale * B @ A)`` over the active adapters, in float32, back in W's dtype."""
    weight = sd[keys[0]]
    if len(keys) == 1:
        return weight.contiguous()
    acc = weight.float()
    for a_key, b_key in zip(keys[1::2], keys[2::2], strict=True):
        adapter = a_key.rsplit(".", 2)[-2]
        delta = sd[b_key].float() @ sd[a_key].float()
        if mod.fan_in_fan_out:
            delta = delta.T
        acc = acc + delta * mod.scaling[adapter]
    return acc.to(weight.dtype).contiguous()


def fold_state_dict(sd: dict[str, torch.Tensor], plan: LoraFoldPlan) -> dict[str, torch.Tensor]:
    """``sd`` of the PEFT model -> the base model's state dict with the adapters folded in."""
    folded = {f"{name}.base_layer.weight": _folded(mod, _fold_keys(name, mod), sd) for name, mod in plan.layers}
    return {new: folded.get(key, value) for key, value in sd.items() if (new := plan.rename(key)) is not None}


def lora_layer_keys(plan: LoraFoldPlan | None) -> dict[str, str]:
    """Each entry a LoRA layer's merge reads (base weight, adapters) -> that layer's name."""
    if plan is None:
        return {}
    return {key: name for name, mod in plan.layers for key in _fold_keys(name, mod)}


def lora_fold_stream(plan: LoraFoldPlan | None,
                     entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``entries`` of the PEFT model -> the base model's, each LoRA layer merged as soon as its
    pieces have come by: no more than one layer's pieces are held at a time."""
    if plan is None:
        yield from entries
        return
    layer_of: dict[str, tuple[Any, list[str]]] = {}
    for name, mod in plan.layers:
        keys = _fold_keys(name, mod)
        for key in keys:
            layer_of[key] = (mod, keys)
    pieces: dict[str, torch.Tensor] = {}
    for key, value in entries:
        hit = layer_of.get(key)
        if hit is None:
            if (new := plan.rename(key)) is not None:
                yield new, value
            continue
        mod, keys = hit
        pieces[key] = value
        if all(k in pieces for k in keys):
            weight = _folded(mod, keys, pieces)
            for k in keys:
                del pieces[k]
            if (new := plan.rename(keys[0])) is not None:
                yield new, weight
