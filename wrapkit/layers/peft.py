"""PEFT's ``PeftModel``: the base model with adapter layers injected in place.

Besides peeling the layer, this module holds what the rest of the package needs to
know about PEFT's injected layers: how to run the model with the adapters off
(``adapters_off``) and how its state-dict keys map to the base model's
(``base_key_map``).
"""

from __future__ import annotations

import contextlib
import enum
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._errors import UnsupportedModelError
from .._imports import is_instance
from .._names import canonical_name
from ..base.module_internals import own_buffers, own_parameters
from ._layer import Layer

__all__ = ["PeftLayer", "adapters_off", "base_key_map", "KeyMap", "merged_layers", "ADAPTER_WEIGHTS",
           "ADAPTER_CONFIG", "ADAPTER_PICKLE", "saved_key_map", "write_adapter_config", "config_problems"]


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


def base_key_map(peft_model: torch.nn.Module) -> KeyMap:
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
    return KeyMap(prefix, kept)


class KeyMap:
    """A PEFT model's key -> the base model's (a callable); plain data, so that pipeline stages can join theirs.
    ``kept``: each injected layer -> its child holding the base model's weights."""

    def __init__(self, prefix: str, kept: dict[str, str]) -> None:
        self.prefix, self.kept = prefix, kept
        # Longest first: the innermost of nested injected layers is unfolded first.
        self._layers = sorted(kept, key=len, reverse=True)

    def joined(self, other: KeyMap) -> KeyMap:
        return KeyMap(self.prefix, self.kept | other.kept)

    def __call__(self, key: str) -> str | None:
        for layer in self._layers:  # each at most once, inner before outer
            if not key.startswith(layer + "."):
                continue
            rest, child = key[len(layer) + 1:], self.kept[layer] + "."
            if not rest.startswith(child):
                return None  # an adapter's own tensor
            key = f"{layer}.{rest[len(child):]}"
        head = self.prefix + "." if self.prefix else ""
        return key[len(head):] if key.startswith(head) else None


























@contextlib.contextmanager
def _not_distributed(base: torch.nn.Module) -> Iterator[None]:
    """Inside, PEFT does not see the mark of a model transformers distributed itself (``_tp_size``, which
    ``distributed_config`` sets for pipeline stages too): on it PEFT copies every tensor to the CPU, gathering
    each, and the stand-ins it must hand back by identity would be lost (and copied off the meta device)."""
    marked = "_tp_size" in vars(base)
    value = vars(base).pop("_tp_size", None)
    try:
        yield
    finally:
        if marked:
            vars(base)["_tp_size"] = value


# -- adapter checkpoints: PEFT's own file layout ---------------------------------------------------
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_PICKLE = "adapter_model.bin"  # PEFT's layout with safe_serialization=False


def saved_key_map(peft_model: torch.nn.Module, adapter_name: str) -> dict[str, str]:
    """Canonical key -> the key PEFT writes for it in ``adapter_name``'s ``adapter_model.safetensors``,
    for every tensor PEFT saves of that adapter (LoRA matrices, ``modules_to_save`` copies, biases or
    embeddings where its config says so).

    The selection and the renaming are PEFT's own: ``get_peft_model_state_dict`` is handed a stand-in
    for every tensor of the model, and the stand-ins it returns are recognised by identity. So the
    mapping follows the installed PEFT, and nothing is gathered to compute it. ``UnsupportedModelError``
    for adapters PEFT computes rather than selects (prompt learning, trainable tokens)."""
    from peft.utils import get_peft_model_state_dict

    model: Any = peft_model
    config = model.peft_config[adapter_name]
    if getattr(config, "is_prompt_learning", False):
        raise UnsupportedModelError(
            f"adapter {adapter_name!r} is {config.peft_type} prompt learning, whose saved embeddings PEFT computes "
            "from the prompt encoder; adapters_only saves adapters that PEFT injects as layers (LoRA and the like)."
        )
    # The keys as the modules name them (wrappers' infixes included), which PEFT up to 0.21 matches against its
    # layers' module names, and the same stand-ins under the names without them, which PEFT 0.22 expects (it
    # strips the infixes from its module names, and selects nothing under FSDP1's): a tensor either call
    # selects is saved. The file gets the names without.
    stand_ins: dict[str, torch.Tensor] = {}
    canonical: dict[int, str] = {}
    for mod_name, mod in peft_model.named_modules(remove_duplicate=False):
        for name, _ in [*own_parameters(mod), *own_buffers(mod, persistent=True)]:
            key = f"{mod_name}.{name}" if mod_name else name
            t = stand_ins[key] = torch.empty(0, device="meta")
            canonical[id(t)] = canonical_name(key)
    # Offline for the call: with a Hub model id in the config, PEFT would ask the Hub whether the vocabulary
    # was resized, and ranks that got different answers would select different tensors, then gather
    # different units. Embeddings go in where the config targets them, as PEFT decides without the Hub.
    with _offline(), _not_distributed(model.get_base_model()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        selected = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter_name)
        if any(canonical[id(t)] != key for key, t in stand_ins.items()):
            bare = {canonical[id(t)]: t for t in stand_ins.values()}
            selected.update(get_peft_model_state_dict(model, state_dict=bare, adapter_name=adapter_name))
    out: dict[str, str] = {}
    computed = []
    for saved, t in selected.items():
        own = canonical.get(id(t))
        if own is None:
            computed.append(saved)
        else:
            out[own] = canonical_name(saved)
    if computed:
        raise UnsupportedModelError(
            f"PEFT computes {len(computed)} saved tensor(s) of adapter {adapter_name!r} ({', '.join(computed[:3])}) "
            "instead of taking them from the model's parameters; adapters_only cannot gather those. Save with "
            "PEFT's own save_pretrained on an unsharded model."
        )
    return out


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def write_adapter_config(peft_model: torch.nn.Module, adapter_name: str, directory: str) -> None:
    """``adapter_config.json`` of ``adapter_name`` into ``directory``, as PEFT's ``save_pretrained``
    leaves it: marked for inference, naming the base model where it knows it."""
    import copy

    model: Any = peft_model
    config = copy.deepcopy(model.peft_config[adapter_name])
    config.inference_mode = True
    base = model.get_base_model()
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    mapping = None
    if getattr(config, "task_type", None) is None:  # AutoPeftModel finds the base class from this
        mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    config.save_pretrained(directory, auto_mapping_dict=mapping)


# The fields of an adapter's config that decide its tensors' shapes or what the layers compute with them:
# loading weights saved under other values would be silently wrong.
_COMPARED = ("peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "rank_pattern", "alpha_pattern",
             "use_rslora", "use_dora", "bias", "fan_in_fan_out", "modules_to_save", "layers_to_transform")


def _normal(value: Any) -> Any:
    if isinstance(value, (set, frozenset, list, tuple)):
        return sorted(map(str, value))
    return value.value if isinstance(value, enum.Enum) else value  # PeftType as JSON holds it


def config_problems(peft_model: torch.nn.Module, adapter_name: str, saved: Mapping[str, Any], where: str) -> list[str]:
    """Each field of the saved ``adapter_config.json`` (``saved``) that differs from the live adapter's."""
    model: Any = peft_model
    live = model.peft_config[adapter_name].to_dict()
    out = []
    for field in _COMPARED:
        if field not in live and field not in saved:
            continue
        theirs, ours = _normal(saved.get(field)), _normal(live.get(field))
        if theirs != ours:
            out.append(f"adapter {adapter_name!r}: {field} is {theirs!r} in {where}, {ours!r} in the model")
    return out
