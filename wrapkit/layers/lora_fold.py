"""LoRA folded into the base weights as they are exported: the plan of which layers carry adapters (read once per
model), each layer's merged weight computed from its own tensors, fused experts included."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from .._errors import UnsupportedModelError
from .._imports import is_instance
from .._names import canonical_name
from .peft import KeyMap, base_key_map

__all__ = ["LoraFoldPlan", "LoraLayer", "_base_key", "_experts_delta", "_foldable", "_folded", "_layer",
           "_param_wrapper", "fold_plan", "fold_state_dict", "lora_fold_stream", "lora_layer_keys"]


# -- LoRA folding: merged weights computed from the pieces, the live model left as it is ----------
class LoraLayer(NamedTuple):
    """One LoRA layer to fold, as plain data: ``keys`` are the entries its merged weight is computed from (its
    base weight first, then each active adapter's A and B), ``scaling`` each adapter's factor."""

    name: str
    keys: list[str]
    scaling: dict[str, float]
    fan_in_fan_out: bool
    transposed: bool  # a ParamWrapper's experts stored (E, in, out)


class LoraFoldPlan:
    """What ``merge_adapters`` needs to know of the live PEFT model, read without touching it: how its keys
    map to the base model's, and the LoRA layers to fold. Plain data: the stages of a pipeline join theirs."""

    def __init__(self, rename: KeyMap, layers: list[LoraLayer]) -> None:
        self.rename = rename
        self.layers = layers

    @classmethod
    def join(cls, plans: list[LoraFoldPlan]) -> LoraFoldPlan:
        """One plan from several models' (pipeline stages'), each layer once."""
        rename, layers = plans[0].rename, {layer.name: layer for layer in plans[0].layers}
        for plan in plans[1:]:
            rename = rename.joined(plan.rename)
            for layer in plan.layers:
                layers.setdefault(layer.name, layer)
        return cls(rename, list(layers.values()))


def fold_plan(peft_root: torch.nn.Module) -> LoraFoldPlan:
    """What merging the LoRA adapters of ``peft_root`` (a PEFT model) needs; ``UnsupportedModelError``
    for layers that cannot be merged (the same on every rank: read off the module's structure)."""
    layers: list[LoraLayer] = []
    problems: list[str] = []
    trained: dict[str, str] = {}  # a modules_to_save wrapper -> the child whose weights the merged model has
    for mod_name, mod in peft_root.named_modules():
        if is_instance(mod, "peft.utils.other", "ModulesToSaveWrapper"):
            child, problem = _trained_copy(mod)
            trained[canonical_name(mod_name)] = child
            if problem:
                problems.append(f"{canonical_name(mod_name)}: {problem}")
            continue
        if not is_instance(mod, "peft.tuners.tuners_utils", "BaseTunerLayer"):
            continue
        name = canonical_name(mod_name)
        if any(name.startswith(f"{w}.") for w in trained):
            continue  # inside a modules_to_save wrapper: refused there when it is the merged model's
        if not _foldable(mod):
            problems.append(f"{name}: {type(mod).__module__}.{type(mod).__name__}")
            continue
        for adapter in mod.active_adapters:
            # lora_bias appeared in PEFT 0.14; older layers have none.
            if mod.use_dora.get(adapter) or getattr(mod, "lora_bias", {}).get(adapter):
                problems.append(f"{name}: adapter {adapter!r} uses DoRA or a LoRA bias")
        layers.append(_layer(name, mod))
    if problems:
        raise UnsupportedModelError(
            "a merged export (merge_adapters=True: full_state_dict, stream_full_parameters, save_pretrained, the "
            "engine syncs) folds in LoRA adapters of Linear layers and of parameters (target_parameters) only; "
            "this model has "
            + "; ".join(problems)
            + ". Export with merge_adapters=False, or merge with PEFT's merge_and_unload() on an unsharded copy."
        )
    rename = base_key_map(peft_root)
    # What merge_and_unload() puts in a modules_to_save wrapper's place: its active trained copy.
    return LoraFoldPlan(KeyMap(rename.prefix, rename.kept | trained), layers)


def _trained_copy(wrapper: Any) -> tuple[str, str | None]:
    """The child of a ``modules_to_save`` wrapper that the merged model holds, as PEFT's forward and
    ``merge_and_unload()`` pick it: the active adapter's trained copy, else the original module. With a
    problem where that copy cannot be exported as it is (LoRA layers inside it)."""
    # Older PEFT releases name one active adapter and have no switch to disable it.
    names = getattr(wrapper, "active_adapters", None) or [getattr(wrapper, "active_adapter", None)]
    active = [a for a in names if a in wrapper.modules_to_save]
    if getattr(wrapper, "disable_adapters", False) or not active:
        child, module = "original_module", wrapper.original_module
    else:
        child, module = f"modules_to_save.{active[0]}", wrapper.modules_to_save[active[0]]
    if any(is_instance(m, "peft.tuners.tuners_utils", "BaseTunerLayer") for m in module.modules()):
        return child, "a modules_to_save module with LoRA layers inside"
    return child, None


def _foldable(mod: Any) -> bool:
    return _param_wrapper(mod) or is_instance(mod, "peft.tuners.lora.layer", "Linear")


def _param_wrapper(mod: Any) -> bool:
    """PEFT's LoRA on a parameter (``target_parameters``, e.g. a MoE's fused 3-D experts)."""
    return is_instance(mod, "peft.tuners.lora.layer", "ParamWrapper")


def _base_key(name: str, mod: Any) -> str:
    if not _param_wrapper(mod):
        return f"{name}.base_layer.weight"
    # The parameter sits on the innermost base layer: wrappers of several parameters of one module nest.
    param = mod.get_param()
    rel = next(n for n, p in mod.named_parameters(remove_duplicate=False) if p is param)
    return canonical_name(f"{name}.{rel}")


def _layer(name: str, mod: Any) -> LoraLayer:
    """What folding LoRA layer ``mod`` needs, read off it now."""
    keys = [_base_key(name, mod)]
    if not mod.merged and not mod.disable_adapters:
        for adapter in mod.active_adapters:
            if adapter in mod.lora_A:
                keys += [f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"]
    scaling = {a: float(mod.scaling[a]) for a in mod.active_adapters if a in mod.scaling}
    transposed = _param_wrapper(mod) and bool(getattr(mod.get_base_layer(), "is_transposed", False))
    return LoraLayer(name, keys, scaling, bool(getattr(mod, "fan_in_fan_out", False)), transposed)


def _folded(layer: LoraLayer, sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``W + sum(scale * B @ A)`` over the active adapters, in float32, back in W's dtype."""
    keys = layer.keys
    weight = sd[keys[0]]
    if len(keys) == 1:
        return weight.contiguous()
    acc = weight.float()
    for a_key, b_key in zip(keys[1::2], keys[2::2], strict=True):
        adapter = a_key.rsplit(".", 2)[-2]
        a, b = sd[a_key].float(), sd[b_key].float()
        if weight.dim() == 3:  # a ParamWrapper over stacked experts
            acc = acc + _experts_delta(layer, weight, a, b) * layer.scaling[adapter]
            continue
        delta = b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        acc = acc + delta * layer.scaling[adapter]
    return acc.to(weight.dtype).contiguous()


def _experts_delta(layer: LoraLayer, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The update of a stacked (E, d1, d2) expert weight from LoRA matrices covering every expert:
    ``a`` of shape (r * E, in) holds each expert's rank rows in turn, ``b`` of shape (out, r * E) each
    expert's rank columns interleaved. PEFT orders a weight (E, out, in), unless its module says it
    is transposed, and then (E, in, out)."""
    experts = weight.shape[0]
    a3 = a.reshape(experts, -1, a.shape[-1])  # (E, r, in)
    b3 = b.reshape(b.shape[0], -1, experts)  # (out, r, E)
    delta = torch.einsum("ore,eri->eoi", b3, a3)  # (E, out, in)
    return delta.transpose(1, 2) if layer.transposed else delta


def fold_state_dict(sd: dict[str, torch.Tensor], plan: LoraFoldPlan) -> dict[str, torch.Tensor]:
    """``sd`` of the PEFT model -> the base model's state dict with the adapters folded in."""
    folded = {layer.keys[0]: _folded(layer, sd) for layer in plan.layers}
    return {new: folded.get(key, value) for key, value in sd.items() if (new := plan.rename(key)) is not None}


def lora_layer_keys(plan: LoraFoldPlan | None) -> dict[str, str]:
    """Each entry a LoRA layer's merge reads (base weight, adapters) -> that layer's name."""
    if plan is None:
        return {}
    return {key: layer.name for layer in plan.layers for key in layer.keys}


def lora_fold_stream(plan: LoraFoldPlan | None,
                     entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``entries`` of the PEFT model -> the base model's, each LoRA layer merged as soon as its
    pieces have come by: no more than one layer's pieces are held at a time."""
    if plan is None:
        yield from entries
        return
    layer_of = {key: layer for layer in plan.layers for key in layer.keys}
    pieces: dict[str, torch.Tensor] = {}
    for key, value in entries:
        layer = layer_of.get(key)
        if layer is None:
            if (new := plan.rename(key)) is not None:
                yield new, value
            continue
        pieces[key] = value
        if all(k in pieces for k in layer.keys):
            weight = _folded(layer, pieces)
            for k in layer.keys:
                del pieces[k]
            if (new := plan.rename(layer.keys[0])) is not None:
                yield new, weight
