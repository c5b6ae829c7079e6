"""Shared machinery behind ``gathered()``, ``generation()`` and ``named_full_parameters()``.

The fast path rests on one idea: once every parameter is full, the model can run
as a plain module, provided nothing sharded stays in the call path. ``bypassed``
takes what the backend says stands in the way (its ``Bypass``: FSDP1's wrappers in
the module tree, the forward hooks FSDP2 and ZeRO-3 put on each module) out of it,
gives every module a plain parameter dict (ZeRO-3 installs one that checks each
access) and clears the flag that makes transformers' ``generate()`` all-reduce at
every step. Everything is put back, object for
object, on exit: the backend's own state (ZeRO-3's parameter coordinator, FSDP's
reshard settings) is never touched, so nothing needs to be re-registered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ._agree import is_distributed
from .base.module_internals import buffer_slots, child_slots, forward_hook_dicts, parameter_slots, swap_parameter_slots

__all__ = [
    "all_gather_into",
    "bypassed", "Bypass", "broadcast_", "Replace",
    "set_modes", "restore_modes", "set_checkpointing", "restore_checkpointing", "generation_modes",
    "synced_generate", "submodules",
]

# Returns the tensor to put in place of the module's parameter ``name``, or None to keep it.
Replace = Callable[[torch.nn.Module, str, torch.Tensor], "torch.Tensor | None"]


class Bypass(NamedTuple):
    """What a backend puts between a module holding full parameters and a plain forward, which
    ``bypassed`` takes out of the call path; each backend's adapter gives its own (``gather_bypass``)."""

    # Forward hooks, and bound method wrappers in a module's instance dict, whose code lives under
    # these module prefixes.
    hook_modules: tuple[str, ...]
    # The module a child stands for, where the child is a wrapper of the backend's (else the child).
    peel: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    # Instance flags set to False meanwhile: marks the backend leaves for other libraries, which then
    # treat the module as still sharded (transformers' generate() syncs every rank at every step on one).
    flags_off: tuple[str, ...] = ()
    # Instance attributes given other values meanwhile (module -> {name: value}): counts a backend shrank
    # to this rank's share, which a plain forward over the full parameters must not read (transformers'
    # expert parallelism sets ``num_experts`` to this rank's experts).
    attrs: Callable[[torch.nn.Module], dict[str, Any]] | None = None


def submodules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``root`` and every module below it, each once: ``modules()`` without the names it builds
    for every module, several times faster, for walks made at every call (a frequent sync)."""
    out, seen, todo = [], set(), [root]
    while todo:
        mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append(mod)
        todo.extend(child for child in reversed(child_slots(mod).values()) if child is not None)
    return out


def walk_tensors(root: torch.nn.Module, shard: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """``shard(p)`` of every parameter, then every buffer, module by module in ``submodules``' order, in one walk
    of the modules' own dicts: a cached sync fingerprints both models with it at every call."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [root]
    while todo:
        mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out += [shard(p) for p in parameter_slots(mod).values() if p is not None]
        out += [b for b in buffer_slots(mod).values() if b is not None]
        todo += [child for child in reversed(child_slots(mod).values()) if child is not None]
    return out


def all_gather_into(recv: torch.Tensor, send: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``send``, end to end in ``recv``: torch's ``all_gather_single`` where it has it
    (newer releases deprecate ``all_gather_into_tensor``, warning at every call), else the older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=group)


def broadcast_(tensors: Sequence[torch.Tensor], src: int, group: Any, world_size: int) -> None:
    """Broadcast each tensor in place from group rank ``src``."""
    if not is_distributed(world_size):
        return
    global_src = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, global_src, group=group)


def _defined_under(hook: Any, prefixes: tuple[str, ...]) -> bool:
    for obj in (hook, getattr(hook, "func", None), getattr(hook, "__wrapped__", None),
                getattr(hook, "__func__", None)):
        mod = getattr(obj, "__module__", None) or ""
        if mod.startswith(prefixes):
            return True
    return False


@contextlib.contextmanager
def bypassed(root: torch.nn.Module, bypass: Bypass, replace: Replace | None = None) -> Iterator[torch.nn.Module]:
    """Run ``root`` as a plain module: without what ``bypass`` names, with plain parameter dicts.

    ``replace`` may substitute a full tensor for a parameter (FSDP2's DTensors).
    The parameters must already be full. Restores every object exactly on exit.
    """
    children: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    param_dicts: list[tuple[torch.nn.Module, Any]] = []
    hook_dicts: list[tuple[dict[int, Any], list[tuple[int, Any]]]] = []
    flags: list[tuple[torch.nn.Module, str]] = []
    methods: list[tuple[torch.nn.Module, str, Any]] = []
    attrs: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        todo, seen = [root], set()
        while todo:
            mod = todo.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            slots = child_slots(mod)
            for name, child in list(slots.items()):
                if child is None:
                    continue
                inner = bypass.peel(child) if bypass.peel is not None else child
                if inner is not child:
                    children.append((mod, name, child))
                    slots[name] = inner
                todo.append(inner)
            params: dict[str, Any] = {}
            for name, p in parameter_slots(mod).items():
                new = replace(mod, name, p) if (replace is not None and p is not None) else None
                params[name] = p if new is None else new
            param_dicts.append((mod, swap_parameter_slots(mod, params)))
            for flag in bypass.flags_off:
                if mod.__dict__.get(flag):
                    flags.append((mod, flag))
                    mod.__dict__[flag] = False
            for name, value in (bypass.attrs(mod) if bypass.attrs is not None else {}).items():
                attrs.append((mod, name, mod.__dict__[name]))
                mod.__dict__[name] = value
            for hooks in forward_hook_dicts(mod):
                foreign = [k for k, h in hooks.items() if _defined_under(h, bypass.hook_modules)]
                if foreign:
                    hook_dicts.append((hooks, list(hooks.items())))
                    for k in foreign:
                        del hooks[k]
            # FSDP2's register_fsdp_forward_method (transformers' Trainer applies it to
            # ``generate``) puts a bound wrapper in the instance dict that runs the sharding
            # hooks around the method, and transformers' tensor parallelism a closure in place
            # of ``forward``; the class's own method is what a plain module calls.
            for name, value in list(mod.__dict__.items()):
                if _is_method_wrapper(mod, name, value, bypass.hook_modules):
                    methods.append((mod, name, value))
                    del mod.__dict__[name]
        yield root
    finally:
        for mod, name, value in reversed(methods):
            mod.__dict__[name] = value
        # Put the same objects back in place (same dicts, same order), so hook handles keep working.
        for hooks, items in reversed(hook_dicts):
            hooks.clear()
            hooks.update(items)
        for mod, original in reversed(param_dicts):
            swap_parameter_slots(mod, original)
        for parent, name, child in reversed(children):
            child_slots(parent)[name] = child
        for mod, flag in flags:
            mod.__dict__[flag] = True
        for mod, name, value in reversed(attrs):
            mod.__dict__[name] = value


def _is_method_wrapper(mod: torch.nn.Module, name: str, value: Any, prefixes: tuple[str, ...]) -> bool:
    """Whether ``value``, in ``mod``'s instance dict, stands in for the class's method ``name``: a
    method bound to ``mod`` or a plain function, defined under ``prefixes``."""
    if not callable(value) or not callable(getattr(type(mod), name, None)):
        return False
    if getattr(value, "__self__", mod) is not mod:
        return False
    # functools.wraps copies the wrapped method's __module__; the globals tell where it was defined.
    defined_in = getattr(getattr(value, "__func__", value), "__globals__", {}).get("__name__", "")
    return (str(defined_in) + ".").startswith(prefixes)


def set_modes(root: torch.nn.Module, training: bool) -> list[tuple[torch.nn.Module, bool]]:
    """Set every submodule's ``training`` flag; return the previous flags for ``restore_modes``."""
    saved = [(m, m.training) for m in root.modules()]
    for m, _ in saved:
        m.training = training
    return saved


def restore_modes(saved: list[tuple[torch.nn.Module, bool]]) -> None:
    for m, flag in saved:
        m.training = flag


def set_checkpointing(root: torch.nn.Module, enabled: bool) -> list[tuple[torch.nn.Module, Any]]:
    """Set transformers' per-layer ``gradient_checkpointing`` attribute; return the old values."""
    saved = [(m, m.__dict__["gradient_checkpointing"]) for m in root.modules()
             if "gradient_checkpointing" in m.__dict__]
    for m, _ in saved:
        m.__dict__["gradient_checkpointing"] = enabled
    return saved


def restore_checkpointing(saved: list[tuple[torch.nn.Module, Any]]) -> None:
    for m, value in saved:
        m.__dict__["gradient_checkpointing"] = value


@contextlib.contextmanager
def generation_modes(root: torch.nn.Module) -> Iterator[None]:
    """No autograd, every submodule in eval mode, gradient checkpointing off; the flags and
    settings put back exactly on exit, exception or not."""
    with torch.no_grad():
        modes = set_modes(root, False)
        ckpt = set_checkpointing(root, False)
        try:
            yield
        finally:
            restore_checkpointing(ckpt)
            restore_modes(modes)


_MISSING = object()


@contextlib.contextmanager
def shared_rng(group: Any) -> Iterator[None]:
    """Inside, every rank of ``group`` draws the random numbers its first rank draws, so that pipeline stages
    sample the same tokens from the logits they share. On exit the first rank keeps its advanced generator,
    the others get their own back. Nothing happens without a group."""
    if group is None:
        yield
        return
    first = dist.get_global_rank(group, 0)
    gpu = dist.get_backend(group) != "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    own = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if gpu else [])
    shared = [state.to(device) for state in own]
    for state in shared:
        dist.broadcast(state, src=first, group=group)
    torch.set_rng_state(shared[0].cpu())
    if gpu:
        torch.cuda.set_rng_state(shared[1].cpu())
    try:
        yield
    finally:
        if dist.get_rank() != first:
            torch.set_rng_state(own[0])
            if gpu:
                torch.cuda.set_rng_state(own[1])


@contextlib.contextmanager
def synced_generate(root: torch.nn.Module) -> Iterator[None]:
    """Make transformers' ``generate()`` keep every rank stepping until all are done.

    When each forward gathers weights collectively, a rank that finished its sequences
    must still run forwards while another decodes, or the group hangs. ``generate()``
    does so (``synced_gpus``) for modules carrying FSDP's ``_is_fsdp_managed_module``
    flag, which ZeRO-3 modules lack unless transformers' own DeepSpeed config is set.
    The flag is set on every submodule inside and put back as it was on exit."""
    saved = [(m, m.__dict__.get("_is_fsdp_managed_module", _MISSING)) for m in root.modules()]
    for m, _ in saved:
        m.__dict__["_is_fsdp_managed_module"] = True
    try:
        yield
    finally:
        for m, value in saved:
            if value is _MISSING:
                m.__dict__.pop("_is_fsdp_managed_module", None)
            else:
                m.__dict__["_is_fsdp_managed_module"] = value
