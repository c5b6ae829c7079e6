"""Placement and freezing: ``place()`` and ``to_eval_frozen()`` on every backend.

Backends supply the primitives: ``move`` (how this rank's parameters travel),
``placement_tensors`` (what must sit on the target afterwards), ``frozen_parameters``,
and ``frozen_form``. The checks, the rollback and the cross-rank agreement
are written here once: a move that fails on one rank is rolled back where it can be and
reported on every rank, so no rank goes on with a model the others gave up on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._agree import Call, any_over_models, enter
from .._errors import DistributedStateError, PlacementError, first_few
from .._gather import set_modes

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["place", "to_eval_frozen", "move_verified", "resolve_device", "home_device", "remember_home"]

# Attribute on the innermost model recording its compute device while it is offloaded: kept on
# the model, so that place() comes back from any adapter over it.
_HOME_ATTR = "_placement_home_device"


def resolve_device(device: torch.device | str | int) -> torch.device:
    """A concrete device: ``"cuda"`` becomes ``cuda:<current>``, an int a CUDA index.

    ``PlacementError`` for what is not a device, or a device this process cannot use."""
    try:
        if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"a {type(device).__name__}")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise PlacementError(f"{device!r} is not a device ({exc}); pass e.g. 'cpu', 'cuda', 'cuda:1', a "
                             "torch.device, or an int for a CUDA index") from None
    module = getattr(torch, dev.type, None) if dev.type not in ("cpu", "meta") else None
    if module is not None and callable(getattr(module, "is_available", None)):
        if not module.is_available():
            raise PlacementError(f"{dev} is not available here: this torch build or machine has no "
                                 f"{dev.type} device; pass 'cpu', or install a {dev.type} build of torch")
        count = module.device_count() if callable(getattr(module, "device_count", None)) else None
        if dev.index is None:
            dev = torch.device(dev.type, module.current_device())
        elif count is not None and dev.index >= count:
            raise PlacementError(f"{dev} does not exist: this process sees {count} {dev.type} device(s); "
                                 f"pass an index below {count}")
    return dev


def home_device(wm: Adapter) -> torch.device:
    """Where ``wm`` computes: its current device, or the one it was offloaded from."""
    home = wm.unwrap(keep_peft=False).__dict__.get(_HOME_ATTR)
    return home if isinstance(home, torch.device) else resolve_device(wm.device)


def place(wm: Adapter, device: torch.device | str | int | None = None, op: str = "place") -> None:
    """Move this rank's parameters and shards to ``device`` (``None``: the compute device), keeping
    the sharding, and verify every one of them. Collective over the model's group."""
    home = home_device(wm)
    problem: PlacementError | None = None
    try:
        target = home if device is None else resolve_device(device)
    except PlacementError as exc:
        problem, target = exc, home
    # Agreed before anything moves: a device one rank cannot use stops every rank. The device
    # itself is each rank's own (its GPU index), but its kind must be the same everywhere.
    bad, on_cpu, elsewhere = enter(Call.of(op), wm, flags=[problem is not None, target.type == "cpu",
                                                          target.type != "cpu"], invalid=1)
    if bad:
        raise problem or PlacementError(f"place({device!r}) names a device another rank of the {wm.name} "
                                        "group cannot use; see its error")
    if on_cpu and elsewhere:
        raise DistributedStateError(
            f"{op}({device!r}) moves this rank's shards to {target}, while other ranks of the {wm.name} group "
            "move theirs to the CPU (or the other way round); name the same kind of device on every rank.")
    move_verified(wm, target, copy=False)
    remember_home(wm, home, back=target == home)


def remember_home(wm: Adapter, home: torch.device, back: bool = False) -> None:
    """Record the compute device of a model moved away from it (``back``: it is home again)."""
    state = wm.unwrap(keep_peft=False).__dict__
    if back:
        state.pop(_HOME_ATTR, None)
    else:
        state[_HOME_ATTR] = home


def to_eval_frozen(wm: Adapter) -> Adapter:
    """Eval mode on every submodule, ``requires_grad=False`` on every parameter, placed on the
    compute device; sharded backends stay sharded, replicated wrappers are dropped. Idempotent."""
    frozen = wm.frozen_form()
    if frozen is not wm:
        place(frozen, wm.device, "to_eval_frozen")
    # Placement first: it is the step that can fail, and it rolls itself back.
    place(frozen, op="to_eval_frozen")
    frozen.module.eval()
    set_modes(frozen.module, False)  # also reaches modules whose train() override skips children
    for p in frozen.placement.frozen_parameters():
        p.requires_grad_(False)
    return frozen


def move_verified(wm: Adapter, target: torch.device, copy: bool) -> None:
    """Move to ``target``, roll back on failure, verify, and agree on the outcome across ranks.

    ``copy=True`` forces fresh storage even when a tensor is already on ``target`` (what an
    offload does between two devices), so the bookkeeping of every backend is exercised on a
    machine that has one device only.
    """
    sources = {t.device for _, t in wm.placement.tensors()}
    failure: BaseException | None = None
    rolled_back = False
    try:
        wm.placement.move(target, copy)
    except Exception as exc:
        failure = exc
        if len(sources) == 1 and target not in sources:  # came from one device: go back there
            try:
                wm.placement.move(next(iter(sources)), False)
                rolled_back = True
            except Exception:
                pass
    off = [name for name, t in wm.placement.tensors() if t.device != target]
    if any_over_models(failure is not None or bool(off), wm):
        shown = first_few(off, 8)
        if failure is not None:
            msg = (f"moving the {wm.name} model's parameters to {target} failed ({type(failure).__name__}: "
                   f"{failure})" + (f"; moved back to {next(iter(sources))}" if rolled_back else "")
                   + (f"; not on {target}: {shown}" if off and not rolled_back else "") + ".")
        elif off:
            msg = (f"after moving the {wm.name} model to {target}, these are elsewhere: {shown}; "
                   "something outside the backend holds them (move or re-create them) or the backend is "
                   "mid-step (call place() between steps).")
        else:
            msg = f"placement on {target} failed on another rank of the {wm.name} group; see its error."
        raise PlacementError(msg) from failure
