"""What every backend's likeness (``Likeness.wrap`` and ``Likeness.copy``) shares: the transformer blocks that become
units, an empty skeleton of the model's class to shard before it is filled, and the buffers that no
shard holds."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from ..._errors import ReferenceModelError
from ..._names import canonical_name, model_class_name
from .parts import local_tensor

if TYPE_CHECKING:
    from .primitives import AdapterView

__all__ = ["block_classes", "resolve_units", "skeleton", "copy_buffers", "distributed_copy", "replicated_copy",
           "ShardedLikeness", "skip_init"]

A = TypeVar("A", bound="AdapterView")


class ShardedLikeness(Generic[A]):
    """What a sharded backend's likeness shares: it holds its adapter (``model``), a copy never starts from
    the module inside its wrapper (that module is sharded), and by default copies are built without the
    backend's own config and run on torch's own operators."""

    takes_config = False
    own_ops = False

    def __init__(self, model: A) -> None:
        self.model = model

    def start(self) -> torch.nn.Module | None:
        return None


def block_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """Transformer block classes from ``_no_split_modules``; empty means "the root alone"."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def resolve_units(module: torch.nn.Module, groups: list[list[str]]) -> list[list[torch.nn.Module]] | None:
    """The modules of ``module`` at a policy's unit paths (canonical, grouped), or None where there are none or
    one is missing (a reference of another structure: the caller falls back to ``block_classes``). A PEFT
    policy's paths also match a base model without PEFT's prefix."""
    if not groups:
        return None
    by_path = {canonical_name(p): m for p, m in module.named_modules() if p}
    found = []
    for group in groups:
        mods = [by_path.get(p) or by_path.get(p.removeprefix(_PEFT_PREFIX)) for p in group]
        if any(m is None for m in mods):
            return None
        found.append([m for m in mods if m is not None])
    return found


_PEFT_PREFIX = "base_model.model."


def skeleton(adapter: AdapterView, initialise: bool = True) -> torch.nn.Module:
    """A model of ``adapter``'s class, built from its config (weights come later) in its parameters'
    dtype; built under whatever device or ``zero.Init`` context is active. ``initialise=False`` skips
    transformers' weight initialisation (its ties are still made): under ``zero.Init`` the parameters
    are empty partitions, which the initialisers of padding rows index (Gemma 3, reward models)."""
    inner = adapter.unwrap(keep_peft=False)
    cfg = getattr(inner, "config", None)
    if "peft" in adapter.stack or cfg is None:
        why = ("its PEFT model trains weights outside the adapters" if "peft" in adapter.stack
               else f"{model_class_name(inner)} has no config to rebuild it from")
        raise ReferenceModelError(
            f"cannot build a reference for this sharded {adapter.backend} policy without gathering it, because "
            f"{why}; pass ref_model (the model loaded again from its checkpoint)."
        )
    dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    skip = skip_init() if not initialise else None
    if skip is None:
        model = type(inner)(copy.deepcopy(cfg))
    else:
        with skip():
            model = type(inner)(copy.deepcopy(cfg))
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
    differs = _other_modules(inner, model)
    if differs is not None:
        raise ReferenceModelError(
            f"cannot build a reference for this sharded {adapter.backend} policy without gathering it, because its "
            f"modules are not those its config builds ({differs}: replaced after the model was built); pass "
            "ref_model (a copy of the policy's model, or the model loaded again and modified the same way).")
    return model.to(dtype)


def _own_class(mod: torch.nn.Module) -> type:
    """``mod``'s class, not the subclass FSDP2 makes of it when it shards the module."""
    return next(c for c in type(mod).__mro__ if not c.__module__.startswith("torch.distributed"))


def _other_modules(policy: torch.nn.Module, built: torch.nn.Module) -> str | None:
    """Where the model built from the config differs from the policy's (a module of another class, or missing),
    or None. Wrappers of the backends' own (FSDP1 units, checkpoint wrappers) are not the model's modules."""
    def tree(m: torch.nn.Module) -> dict[str, type]:
        # A wrapper's own class is torch.distributed's alone: nothing of it but Module is the model's.
        return {canonical_name(n): cls for n, c in m.named_modules() if (cls := _own_class(c)) is not torch.nn.Module}

    mine, theirs = tree(policy), tree(built)
    for name, cls in mine.items():
        if theirs.get(name) is not cls:
            other = theirs.get(name)
            return (f"{name or 'the root'} is a {cls.__name__} where the config builds "
                    f"{'none' if other is None else 'a ' + other.__name__}")
    extra = next((n for n in theirs if n not in mine), None)
    return None if extra is None else f"the config builds {extra}, which the policy lacks"


def skip_init() -> Any:
    """transformers' context that builds a model without initialising its weights, or None."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return None
    return no_init_weights


def copy_buffers(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Buffers are never sharded; non-persistent ones (rotary tables) are in no state dict. Each takes the
    source's dtype too: the skeleton was cast whole to the weights' dtype, but a bf16 model loaded by
    transformers keeps its rotary tables in float32, and rounded ones would change every logit."""
    theirs = {canonical_name(k): v for k, v in src.named_buffers()}
    with torch.no_grad():
        for path, module in dst.named_modules():
            for key, buf in list(module._buffers.items()):
                other = theirs.get(canonical_name(f"{path}.{key}" if path else key))
                if buf is None or other is None:
                    continue
                if other.dtype == buf.dtype:
                    buf.copy_(other)
                else:
                    module._buffers[key] = other.to(buf.device, copy=True)


def distributed_copy(adapter: AdapterView) -> torch.nn.Module | None:
    """A copy of ``adapter``'s weights laid out as transformers laid the model out, where it recorded how
    (``from_pretrained(..., tp_plan=...)`` or ``distributed_config=``): its ``DistributedConfig`` and
    device mesh applied again by ``maybe_distribute_model`` to an empty skeleton, then each rank's shards
    copied across (same mesh, same placements: nothing gathered). None where transformers did not
    distribute the model: tensor parallelism applied by hand keeps no record of its plan."""
    inner = adapter.unwrap(keep_peft=False)
    config = getattr(getattr(inner, "config", None), "distributed_config", None)
    meshes = getattr(inner, "_mesh_manager", None)
    distribute = getattr(type(inner), "maybe_distribute_model", None)
    if config is None or meshes is None or distribute is None:
        return None
    with torch.device("meta"):
        model = skeleton(adapter)
    model = distribute(model, config, meshes)
    assert isinstance(model, torch.nn.Module)
    model.to_empty(device=adapter.device)
    theirs = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            local_tensor(p).copy_(local_tensor(theirs[name]))
    copy_buffers(inner, model)
    return model


def replicated_copy(adapter: AdapterView, wrap: Callable[[torch.nn.Module, dict[str, Any] | None], torch.nn.Module],
                    ds_config: dict[str, Any] | None) -> torch.nn.Module:
    """A frozen copy of a model whose every rank holds the full weights, wrapped like it (``wrap``)."""
    source = adapter.unwrap(keep_peft=True)
    if any(p.numel() == 0 for p in source.parameters()):
        raise ReferenceModelError(
            f"the {adapter.backend} policy's parameters are not all present on this rank (offloaded or sharded); "
            "call policy.place() first or pass ref_model."
        )
    return wrap(copy.deepcopy(source), ds_config)
