"""The few private fields of ``torch.nn.Module`` (and private functions of torch and transformers)
that wrapkit needs where no public API does the same thing, in one place.

A module's own parameter, buffer and child dicts are read directly because the public walks
(``named_parameters``, ``state_dict``) skip ``None`` slots, drop duplicates, run state-dict hooks
(collectives under FSDP) or cannot tell a persistent buffer from another. Outside ``adapters/``,
which read their own backend's fields, everything goes through these functions
(``tests/project/test_private_reads.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .._names import canonical_name

__all__ = ["assign", "assign_named", "child_slots", "parameter_slots", "buffer_slots", "swap_parameter_slots",
           "forward_hook_dicts",
           "own_parameters", "own_buffers", "is_persistent", "live_entries", "init_weights", "lerp_all_",
           "state_dict_hooks", "load_state_dict_pre_hooks", "state_dict_version"]


def child_slots(mod: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``mod``'s own children by name, the live dict: a write replaces a child in place, without
    ``__setattr__``'s bookkeeping, so putting the original back restores the module exactly."""
    children: dict[str, torch.nn.Module | None] = mod._modules
    return children


def parameter_slots(mod: torch.nn.Module) -> dict[str, Any]:
    """``mod``'s own parameters by name, the live dict (``None`` slots included)."""
    params: dict[str, Any] = mod._parameters
    return params


def buffer_slots(mod: torch.nn.Module) -> dict[str, Any]:
    """``mod``'s own buffers by name, the live dict (``None`` slots and non-persistent ones included)."""
    buffers: dict[str, Any] = mod._buffers
    return buffers


def swap_parameter_slots(mod: torch.nn.Module, slots: dict[str, Any]) -> dict[str, Any]:
    """Give ``mod`` the parameter dict ``slots`` (plain tensors allowed); returns the one it had."""
    old = parameter_slots(mod)
    mod.__dict__["_parameters"] = slots
    return old


def forward_hook_dicts(mod: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """``mod``'s forward pre-hooks and forward hooks, the live dicts keyed by handle id."""
    return mod._forward_pre_hooks, mod._forward_hooks


def state_dict_hooks(mod: torch.nn.Module) -> list[tuple[Callable[..., Any], bool]]:
    """``mod``'s state-dict post-hooks, in the order ``state_dict()`` runs them, each with whether it came
    through the public API (its result must be None) or the private one (a dict it returns replaces the
    state dict)."""
    return [(hook, bool(getattr(hook, "_from_public_api", False))) for hook in mod._state_dict_hooks.values()]


def load_state_dict_pre_hooks(mod: torch.nn.Module) -> list[Callable[..., Any]]:
    """``mod``'s load pre-hooks, in the order ``load_state_dict()`` runs them; each is called as
    ``hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)`` (torch binds
    the module where it was registered with one)."""
    return list(mod._load_state_dict_pre_hooks.values())


def state_dict_version(mod: torch.nn.Module) -> Any:
    """The version ``state_dict()`` records in a module's metadata, which hooks may read."""
    return getattr(mod, "_version", None)


def own_parameters(mod: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``mod``'s own parameters, in registration order; a tied one under each module holding it."""
    for name, p in mod._parameters.items():
        if p is not None:
            yield name, p


def own_buffers(mod: torch.nn.Module, persistent: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``mod``'s own buffers, in registration order: all of them, or only the persistent ones (those
    ``state_dict()`` holds) or only the others."""
    for name, b in mod._buffers.items():
        if b is not None and (persistent is None or is_persistent(mod, name) == persistent):
            yield name, b


def is_persistent(mod: torch.nn.Module, name: str) -> bool:
    """Whether ``mod``'s buffer ``name`` is part of its state dict."""
    return name not in mod._non_persistent_buffers_set


def live_entries(root: torch.nn.Module, *, parameters: bool = True,
                 buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every key ``root.state_dict()`` has, in its order: module by
    module, its parameters (a tied one under each of its names), then its persistent buffers;
    ``parameters`` / ``buffers`` select which. Walked directly, so no state-dict hook runs."""
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        if parameters:
            for name, p in own_parameters(mod):
                yield canonical_name(f"{mod_name}.{name}" if mod_name else name), p
        if buffers:
            for name, b in own_buffers(mod, persistent=True):
                yield canonical_name(f"{mod_name}.{name}" if mod_name else name), b


def init_weights(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """A transformers model's own initialiser of one submodule (it rebuilds non-persistent buffers
    such as rotary ``inv_freq`` from the config); None for other models."""
    init = getattr(model, "_init_weights", None)
    return init if callable(init) else None


def recorded_conversions(model: torch.nn.Module) -> list[Any] | None:
    """The weight conversions transformers' ``from_pretrained`` loaded ``model`` with (it records them
    on the model, and its save reverts them); None for a model built otherwise."""
    found = getattr(model, "_weight_conversions", None)
    return list(found) if found is not None else None


def assign(dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
    """``dst = src`` (``alpha`` 1), else ``dst = alpha * src + (1 - alpha) * dst`` accumulated in float32."""
    if alpha == 1.0 or not dst.is_floating_point():
        dst.copy_(src)
        return
    s = src.to(device=dst.device, dtype=torch.float32)
    d = dst.to(torch.float32)
    dst.copy_(d * (1.0 - alpha) + s * alpha)


def assign_named(live: Mapping[str, torch.Tensor], values: Iterable[tuple[str, torch.Tensor]], alpha: float,
                 local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """``assign`` each of ``values`` (name -> full value) to the tensor ``live`` holds under that name, once per
    tensor (tied names share one); ``local(dst, value)``: the part of the value ``dst`` holds, where it holds only
    a slice. Names ``live`` lacks are skipped."""
    done: set[int] = set()
    with torch.no_grad():
        for name, value in values:
            dst = live.get(name)
            if dst is None or id(dst) in done:
                continue
            done.add(id(dst))
            assign(dst, value if local is None else local(dst, value), alpha)


def lerp_all_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], alpha: float) -> None:
    """``dst = dst * (1 - alpha) + src * alpha`` for every pair, as two fused passes over the lists."""
    torch._foreach_mul_(dsts, 1.0 - alpha)
    torch._foreach_add_(dsts, srcs, alpha=alpha)
