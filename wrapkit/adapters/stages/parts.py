"""The parts of a pipeline stage: the inner storage kind's parts for everything local, and exports that run
through the stage plan (``plan.py``) on every stage in the same order, the owning stage broadcasting each tensor
over the pipeline group."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._agree import Call, enter
from ..._errors import UnsupportedModelError
from ..._gather import Bypass
from ..core.parts import Gatherer, Parts, Piece, Weights, Written
from .plan import StagePlan, plan_of

if TYPE_CHECKING:
    from ..core.primitives import AdapterView

__all__ = ["stage_parts", "stage_buffers", "StageWeights", "StageGatherer"]

Shape = tuple[int, ...]


def stage_parts(model: AdapterView, parts: Parts, plan: StagePlan) -> Parts:
    """``parts`` of a stage's own layers, with the whole model's names, counts and exports. The inner likeness
    is dropped: a copy of a stage is split the way its producer splits one, which the adapter says."""
    weights = StageWeights(parts.weights, plan, model)
    return parts.replace(weights=weights, gatherer=StageGatherer(parts.gatherer, weights, plan, model),
                         likeness=None)


class StageWeights:
    def __init__(self, inner: Weights, plan: StagePlan, model: AdapterView) -> None:
        self.inner, self.plan, self.model = inner, plan, model
        # A write of full values straight into the slices, where the stage's storage kind has one (Megatron's):
        # each stage takes its own layers' values.
        own = getattr(inner, "write_values", None)
        if own is not None:
            self.write_values = own

    def global_numel(self, p: torch.Tensor) -> int:
        return self.inner.global_numel(p)

    def full_shapes(self) -> dict[int, Shape]:
        return self.inner.full_shapes()

    def count(self, trainable_only: bool) -> int:
        plan = self.plan
        if not trainable_only:
            return sum(math.prod(plan.shapes[t]) for t, _ in plan.tensors())
        # Which parameters train can change at any time on any stage: each stage counts its own, so every
        # stage must ask (entered first: a rank asking alone gets an error, not a hang).
        enter(Call.of("num_parameters", trainable_only=True), self.model)
        trains = {n: p.requires_grad for n, p in self.model.named_live(buffers=False)}
        own = sum(math.prod(plan.shapes[t]) for t, s in plan.tensors()
                  if s == plan.stage.number and any(trains.get(n, False) for n in plan.names_of[t]))
        total = torch.tensor([own], dtype=torch.int64)
        dist.all_reduce(total, group=plan.stage.group)
        return int(total.item())

    def param_shapes(self) -> dict[str, Shape]:
        return {name: self.plan.shapes[name] for name in self.plan.order}

    def resident_bytes(self) -> int:
        return self.inner.resident_bytes()

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        return None  # a stage holds some layers only: never paired shard to shard with another layout

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return None

    def pieces(self) -> list[Piece]:
        return self.inner.pieces()  # this stage's own layers only: a load reads just their slices

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        self.inner.written(kind, values)


class StageGatherer:
    """Exports walk the plan on every stage alike: the owner of each tensor broadcasts it."""

    def __init__(self, inner: Gatherer, weights: Weights, plan: StagePlan, model: AdapterView) -> None:
        self.inner, self.weights, self.plan, self.model = inner, weights, plan, model

    def one(self, p: torch.Tensor) -> torch.Tensor:
        return self.inner.one(p)

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        plan, me = self.plan, self.plan.stage.number
        # The dtypes are read now: the model may have been cast since it was adapted.
        dtypes = _exchange(plan, self._own_dtypes())
        local = self.inner.each() if any(s == me for _, s in plan.tensors()) else iter(())
        waiting: dict[str, torch.Tensor] = {}
        kept: dict[str, torch.Tensor] = {}  # tied tensors, until their last name has been yielded
        for name in plan.order:
            t = plan.tensor_of[name]
            names = plan.names_of[t]
            if t in kept:
                value = kept.pop(t) if name == names[-1] else kept[t]
            else:
                s = plan.owner[t]
                mine = _take(local, names, waiting) if s == me else None
                value = plan.broadcast(s, mine, plan.shapes[t], dtypes[s][t], self.model.device)
                if len(names) > 1:
                    kept[t] = value
            yield name, value

    def _own_dtypes(self) -> dict[str, str]:
        plan = self.plan
        owned = {t for t, s in plan.tensors() if s == plan.stage.number}
        out: dict[str, str] = {}
        for name, p in self.model.named_live(buffers=False):
            t = plan.tensor_of.get(name)
            if t in owned and t not in out:
                out[t] = _dtype_name(p)
        return out

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        return None  # a unit is local: an export walks the plan (``each``)

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.inner.many(params)

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.inner.exported(params)

    def full(self, modifier_rank: int | None) -> contextlib.AbstractContextManager[Any]:
        return self.inner.full(modifier_rank)  # this stage's own layers; ``gathered()`` refuses a pipeline

    def layerwise(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.layerwise()

    def bypass(self) -> Bypass | None:
        return self.inner.bypass()

    def full_bytes(self) -> int:
        size = next((p.element_size() for p in self.model.unwrap().parameters()), 4)
        return size * self.weights.count(False)


def stage_buffers(model: AdapterView) -> Iterator[tuple[str, torch.Tensor]]:
    """Every persistent buffer of the whole model (``model.named_live(parameters=False)`` where it is not a
    pipeline stage). Collective on a stage: each buffer comes from the first stage that holds it."""
    plan = plan_of(model)
    if plan is None:
        yield from model.named_live(parameters=False)
        return
    me = plan.stage.number
    local = dict(model.named_live(parameters=False))
    dtypes = _exchange(plan, {n: _dtype_name(local[n]) for n, s in plan.buffer_owner.items() if s == me})
    for name, s in plan.buffer_owner.items():
        value = plan.broadcast(s, local.get(name) if s == me else None, plan.buffer_shapes[name], dtypes[s][name],
                           model.device)
        yield name, value


def _exchange(plan: StagePlan, mine: dict[str, str]) -> list[dict[str, str]]:
    """Every stage's ``mine`` (name -> dtype of what it sends), in stage order."""
    every: list[Any] = [None] * plan.stage.stages
    dist.all_gather_object(every, mine, group=plan.stage.group)
    return every


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _take(local: Iterator[tuple[str, torch.Tensor]], names: list[str],
          waiting: dict[str, torch.Tensor]) -> torch.Tensor:
    """The value of one of ``names`` from this stage's own export, kept in order of the plan; values read
    past it wait in ``waiting`` (the inner part may yield a stage's names in another order)."""
    for name in names:
        if name in waiting:
            return waiting.pop(name)
    for name, value in local:
        if name in names:
            return value
        waiting[name] = value
    raise UnsupportedModelError(f"a pipeline stage's export lacks {names[0]}, which it held when the model was "
                                "adapted; adapt() the model again after changing its layers")
