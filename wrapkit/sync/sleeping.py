"""``sleep()`` / ``wake()``: the whole training state off the compute device and back, for an
inference engine that shares the device between training steps.

``place()`` moves parameters only; a trainer's device also holds gradients and the optimizer's
state (two fp32 moments per parameter under Adam, the larger part). Sleeping moves all three
to the CPU, each rank its own part, sharding kept; level 2 drops the gradients instead of
moving them. A DeepSpeed engine does it with its own ``offload_states`` / ``reload_states``,
which also keep its flat buffers and the views into them consistent; any other backend moves
its parameters through the ``move`` primitive and the torch optimizer's state tensors here.
``wake()`` puts everything back and verifies it as ``place()`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._agree import Call, any_over_models, enter
from .._errors import ArgumentError, DistributedStateError, PlacementError, UnsupportedModelError
from ..adapters.core.parts import States, lacking, local_tensor
from ..references.placement import home_device, move_verified, remember_home

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

from .._results import SleepReport

__all__ = ["SleepReport", "sleep", "wake", "training_state"]

_CPU = torch.device("cpu")





@dataclass
class _Asleep:
    home: torch.device
    moved: list[tuple[dict[str, Any], str]]  # the torch optimizer's state entries moved here
    reload: Callable[[], None] | None  # the backend's own way back (``offload_states``)


# Keyed weakly on the model's outermost module: the state of a model that is collected goes with it.
_ASLEEP: weakref.WeakKeyDictionary[torch.nn.Module, _Asleep] = weakref.WeakKeyDictionary()


def training_state(wm: Adapter, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for this rank's parameters (shards), gradients and optimizer state, each
    storage once."""
    out = list(wm.placement.tensors())
    out += [("grad", local_tensor(p.grad)) for p in wm.placement.frozen_parameters() if p.grad is not None]
    if optimizer is not None:
        out += list(_states(wm).tensors(optimizer))
    seen: set[int] = set()
    unique = []
    for what, t in out:
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key not in seen:
            seen.add(key)
            unique.append((what, t))
    return unique


def _states(wm: Adapter) -> States:
    if wm.states is None:
        raise lacking(wm.backend, "states")
    return wm.states


def _bytes_on(state: list[tuple[str, torch.Tensor]], device: torch.device) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in state
                if t.device == device and t.numel()}
    return sum(storages.values())


def _problem(wm: Adapter, optimizer: Any, level: object) -> str | None:
    if isinstance(level, bool) or level not in (1, 2):
        return f"sleep(level={level!r}): pass 1 (gradients kept, on the CPU) or 2 (gradients dropped)"
    if wm.module in _ASLEEP:
        return "sleep(): the model is asleep already; call wake() first"
    if wm.states is None:
        return f"sleep(): {lacking(wm.backend, 'states')}"
    own = wm.states.own_optimizer()
    if own is not None:
        if optimizer is not None and optimizer is not own and optimizer is not getattr(own, "optimizer", None):
            return (f"sleep(optimizer=...) on a {wm.name} model: the backend's own optimizer is used; pass "
                    "optimizer=None")
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        return (f"sleep(optimizer={type(optimizer).__name__}): pass the torch.optim.Optimizer that steps this "
                "model (or None to move the model alone)")
    return None


def sleep(wm: Adapter, optimizer: Any = None, level: int = 1) -> SleepReport:
    """Move this rank's training state to the CPU; see ``WrappedModel.sleep``. Collective."""
    problem = _problem(wm, optimizer, level)
    refused = wm.states is None
    [bad] = enter(Call.of("sleep", level=level), wm, flags=[problem is not None], invalid=1)
    if bad:
        error = UnsupportedModelError if refused else ArgumentError
        raise error(problem or "sleep() was refused on another rank of the group; see its error")
    home = home_device(wm)
    states = _states(wm)
    opt = states.own_optimizer() or optimizer
    state_bytes = _bytes_on(training_state(wm, opt), home)
    grads = [p for p in wm.placement.frozen_parameters() if p.grad is not None]
    dropped = 0
    if level == 2:
        # Each storage once: FSDP1's gradients of the original parameters are views into its flat one.
        dropped = _bytes_on([("grad", local_tensor(g)) for p in grads if (g := p.grad) is not None], home)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for p in grads:
            p.grad = None
    moved: list[tuple[dict[str, Any], str]] = []
    reload = states.offload(home)
    if reload is None:
        # A fresh copy even from the CPU: a machine without an accelerator still exercises every
        # backend's bookkeeping, and shows that nothing was left behind (every storage replaced).
        move_verified(wm, _CPU, copy=True)
        inner = getattr(opt, "optimizer", opt)  # ZeRO-0 wraps nothing; keep any wrapper's inner optimizer
        moved = [(state, key) for state in getattr(inner, "state", {}).values() for key, value in state.items()
                 if isinstance(value, torch.Tensor) and value.device == home]
        for state, key in moved:
            state[key] = state[key].to(_CPU, copy=True)
    remember_home(wm, home)
    _ASLEEP[wm.module] = _Asleep(home, moved, reload)
    after = _bytes_on(training_state(wm, opt), home)
    return SleepReport(str(home), state_bytes, state_bytes - after, dropped)


def wake(wm: Adapter) -> None:
    """Everything ``sleep()`` moved, back on the compute device, verified. Collective."""
    asleep = _ASLEEP.get(wm.module)
    [bad] = enter(Call.of("wake"), wm, flags=[asleep is None], invalid=1)
    if bad or asleep is None:
        raise DistributedStateError("wake(): the model is not asleep (on this rank or another); call sleep() "
                                    "first, on every rank")
    if asleep.reload is None:
        move_verified(wm, asleep.home, copy=False)
    else:
        asleep.reload()
        off = [name for name, t in wm.placement.tensors() if t.device != asleep.home]
        if any_over_models(bool(off), wm):
            raise PlacementError(f"after wake() these are not on {asleep.home}: {', '.join(off[:8])}; the "
                                 "backend did not bring them back")
    for state, key in asleep.moved:
        state[key] = state[key].to(asleep.home)
    remember_home(wm, asleep.home, back=True)
    del _ASLEEP[wm.module]
