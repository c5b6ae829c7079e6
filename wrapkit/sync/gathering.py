"""Full parameters on every rank: ``gathered()`` and ``generation()``, on every backend.

Written against the backend primitives: ``gather_full`` makes every parameter full (and
writes back from ``modifier_rank``), ``gather_bypass`` says what of the backend must be taken
out of the call path to run on them (its hooks and wrappers: ``_gather.bypassed``), and ``gather_layerwise``
sets up the backend's own per-unit gathering, for models too big to gather whole. Both
contexts put every submodule's ``training`` flag back on exit, and ``generation()`` also
gradient checkpointing, whatever the body did, exception or not. Both run with torch's own
operators where DeepSpeed has replaced them process-wide (``_torch_ops``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .._agree import Call, check_modifier_rank, enter
from .._errors import ArgumentError, PlacementError, UnsupportedModelError
from .._gather import bypassed, generation_modes, restore_modes, shared_rng, synced_generate
from ..adapters.stages.plan import state_hooks
from ..adapters.stages.whole import whole_in_hub_layout, whole_of_stages, whole_problem
from ..base.memory import BUDGET_ENV, format_bytes, memory_budget
from ..base.torch_ops import torch_ops

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["gathered", "generation", "named_full_parameters", "GATHER_MODES"]

GATHER_MODES = ("auto", "full", "layerwise")
_log = logging.getLogger(__name__.rpartition(".")[0] or __name__)


def _over_budget(wm: Adapter) -> str | None:
    """Why gathering the whole model would not fit on this rank, or None when it fits."""
    if not wm.is_sharded:
        return None
    need, budget = wm.gatherer.full_bytes(), memory_budget(wm.device)
    if need <= budget:
        return None
    return (f"the gathered model takes {format_bytes(need)}, more than the {format_bytes(budget)} this rank "
            f"may still allocate on {wm.device} (free memory less a margin, or {BUDGET_ENV})")


def _refuse_too_big(why: str | None) -> None:
    raise PlacementError(
        f"gathering the whole model does not fit ({why or 'on another rank'}). Generate with "
        "generation(gather='layerwise'), export with save_pretrained() or named_full_parameters(), "
        f"or raise {BUDGET_ENV} if the memory is there."
    )


@contextlib.contextmanager
def gathered(wm: Adapter, modifier_rank: int | None = None, own_stage: bool = False) -> Iterator[torch.nn.Module]:
    """``wm.unwrap()`` holding the full parameters on every rank; see ``WrappedModel.gathered``. On pipeline
    stages, the whole model built anew and filled from every stage; ``own_stage``: each stage's own layers
    gathered within it instead (a load writing each stage's layers)."""
    if not own_stage:
        _refuse_stages(wm, "gathered()", modifier_rank)
    why = _over_budget(wm)
    [too_big] = check_modifier_rank("gathered", modifier_rank, wm, [why is not None])
    if too_big:
        _refuse_too_big(why)
    with _gathered(wm, modifier_rank, whole=not own_stage) as inner:
        yield inner


@contextlib.contextmanager
def _gathered(wm: Adapter, modifier_rank: int | None, whole: bool = True) -> Iterator[torch.nn.Module]:
    layout = wm.hub_layout() if whole else None
    if layout is not None:  # the transformers model the backend's own layout names (Megatron-Core's)
        with whole_in_hub_layout(wm, layout, modifier_rank) as model, torch_ops():
            yield model
        return
    if whole and wm.topology().stage() is not None:
        with whole_of_stages(wm, modifier_rank) as model, torch_ops():
            yield model
        return
    # Modes are restored too: code inside often calls eval() to run the model and forgets train().
    modes = [(m, m.training) for m in wm.module.modules()]
    try:
        with wm.gatherer.full(modifier_rank) as replace, torch_ops():
            bypass = wm.gatherer.bypass()
            if bypass is not None:
                with bypassed(wm.unwrap(), bypass, replace) as inner:
                    yield inner
            else:
                yield wm.unwrap()
    finally:
        restore_modes(modes)


@contextlib.contextmanager
def generation(wm: Adapter, gather: str = "auto") -> Iterator[torch.nn.Module]:
    """``gathered()`` (or per-unit gathering) plus eval mode, no autograd and gradient
    checkpointing off; see ``WrappedModel.generation``."""
    bad = gather not in GATHER_MODES
    # Pipeline stages whose whole model cannot be built generate as they train: every stage steps.
    unbuilt = wm.topology().stage() is not None and whole_problem(wm, None) is not None
    why = None if bad or gather == "layerwise" or unbuilt else _over_budget(wm)
    bad_any, too_big = enter(Call.of("generation", gather=gather), wm, flags=[bad, why is not None], invalid=1)
    if bad_any:
        raise ArgumentError(f"generation(gather=...) got an unknown mode on at least one rank (this rank: "
                            f"{gather!r}); pass one of {', '.join(map(repr, GATHER_MODES))}, the same on every rank")
    splits = wm.is_sharded or wm.topology().stage() is not None  # DDP's stages split the model too
    layerwise = splits and (gather == "layerwise" or (gather == "auto" and (too_big or unbuilt)))
    if gather == "full":
        _refuse_stages(wm, 'generation(gather="full")', None)
    if gather == "full" and too_big:
        _refuse_too_big(why)
    if gather == "auto":
        _log.info("generation(gather='auto') on %s: %s", wm.backend,
                  "layerwise (pipeline stages)" if unbuilt else
                  f"layerwise ({why or 'too big on another rank'})" if layerwise else "full")
    if not layerwise:
        # On stages (and in a backend's own layout) the whole model is a module of its own (the modes set on it),
        # and the stages share their batches, so each stage's whole model samples the same tokens.
        rebuilt = wm.topology().stage() is not None or wm.hub_layout() is not None
        with _gathered(wm, None) as inner, generation_modes(inner if rebuilt else wm.module), \
                shared_rng(wm.topology().pp_group):
            yield inner
        return
    modes = [(m, m.training) for m in wm.module.modules()]
    try:
        with wm.gatherer.layerwise(), generation_modes(wm.module), synced_generate(wm.unwrap()), torch_ops(), \
                shared_rng(wm.topology().pp_group):
            yield wm.unwrap()
    finally:
        restore_modes(modes)


def _refuse_stages(wm: Adapter, op: str, modifier_rank: int | None) -> None:
    """Refuse ``op`` on pipeline stages whose whole model cannot be built; known alike on every rank (the
    model's structure and the call's arguments): no agreement needed before raising."""
    why = whole_problem(wm, modifier_rank) if wm.topology().stage() is not None else None
    if why is not None:
        raise UnsupportedModelError(
            f"{op} holds the whole model on every rank, and each rank of this pipeline holds only its own stage's "
            f"layers: {why}. Use full_state_dict(), named_full_parameters() or stream_full_parameters() for the "
            "whole model's values, and generation(gather='layerwise') (every stage stepping) to generate.")


def named_full_parameters(wm: Adapter) -> Iterator[tuple[str, torch.Tensor]]:
    """``gather_each`` behind the operation's entry (taken at the first ``next()``)."""
    enter(Call.of("named_full_parameters"), wm)
    hooks = state_hooks(wm)  # the module's own state-dict names and tensors, where its hooks make them
    yield from wm.gatherer.each() if hooks is None else hooks.export(wm.gatherer.each())
