"""Pipeline stages: a model whose ranks each hold some of its layers, under the whole model's names.

A stage's parts wrap those of the storage kind its own layers are in (whole tensors, for transformers'
``pp_size``). What a stage holds is read once, when the model is adapted: every stage says which names it
holds and which of them are one tensor (a tied head and embedding), and the plan assigns each tensor of the
whole model to the first stage that holds it. An export then runs through the plan on every stage in the
same order: the stage that owns the next tensor reads it from its own parts and broadcasts it over the
pipeline group, the others receive it. Everything local (counting this rank's bytes, moving its tensors,
loading its own layers from a checkpoint) is the inner part's, unchanged.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ..._agree import Call, enter
from ..._errors import UnsupportedModelError
from ..._gather import Bypass
from ..._imports import lookup
from ...formats.hub import HubLayout, Layout
from ...layers.peft import saved_key_map
from ..core.foreign import CUT_STAGE, TRANSFORMERS_STAGES
from ..core.parts import Gatherer, Parts, Piece, Weights, Written

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["Stage", "StagePlan", "recorded_stage", "adopt_torch_stage", "record", "stage_parts", "stage_buffers",
           "buffer_shapes", "state_keys", "is_stage", "transformers_stage", "layout_of", "every_stage",
           "stage_adapter_keys"]

Shape = tuple[int, ...]


class Stage(NamedTuple):
    """This rank's place in a pipeline: ``group`` has one rank per stage, in stage order."""

    group: Any
    number: int  # this rank's stage
    stages: int
    producer: str


# The module of each torch.distributed.pipelining stage handed to adapt(): the stage object holds the group,
# the module does not. Weak: a module that is gone needs no entry.
_TORCH_STAGES: weakref.WeakKeyDictionary[torch.nn.Module, Stage] = weakref.WeakKeyDictionary()


def recorded_stage(model: torch.nn.Module) -> Stage | None:
    """The pipeline stage ``model`` is, as transformers records it on the model or as the
    ``torch.distributed.pipelining`` stage it was adapted through; None for a model that is no stage."""
    return transformers_stage(model) or _TORCH_STAGES.get(model)


def adopt_torch_stage(obj: Any) -> Any:
    """For a ``torch.distributed.pipelining`` stage: its module, recorded with the stage's place; else ``obj``."""
    base = lookup("torch.distributed.pipelining.stage", "_PipelineStageBase")
    if base is None or not isinstance(obj, base):
        return obj
    stage: Any = obj
    group = stage.group if stage.group is not None else dist.group.WORLD
    ranks = dist.get_world_size(group)
    if stage.num_stages != ranks or stage.stage_index != dist.get_rank(group):
        raise UnsupportedModelError(
            f"this rank holds stage {stage.stage_index} of {stage.num_stages} over a group of {ranks} ranks: several "
            "stages per rank (virtual stages, interleaved schedules) are not read yet. Build one stage per rank, "
            "stage i on the group's rank i.")
    module: torch.nn.Module = stage.submod
    record(module, Stage(group, stage.stage_index, stage.num_stages, CUT_STAGE))
    return module


def record(module: torch.nn.Module, stage: Stage) -> None:
    """``module`` is a ``torch.distributed.pipelining`` stage at ``stage`` (a copy of one, for references)."""
    _TORCH_STAGES[module] = stage


def transformers_stage(model: torch.nn.Module) -> Stage | None:
    """The stage transformers' ``DistributedConfig(pp_size=...)`` recorded on ``model``, or None."""
    stage: Any = getattr(model, "_pp_stage", None)
    group = getattr(stage, "pp_group", None)
    size = getattr(stage, "pp_size", None)
    if group is None or not isinstance(size, int) or size < 2:
        return None
    return Stage(group, int(stage.pp_rank), size, TRANSFORMERS_STAGES)


class _Held(NamedTuple):
    """What one stage holds: each parameter name with its shape, the names that are one tensor, its persistent
    buffers, and transformers' tie map (tied copy -> what it is tied to), which only the last stage keeps."""

    names: list[tuple[str, Shape]]
    ties: list[list[str]]
    buffers: list[tuple[str, Shape]]
    tied_keys: dict[str, str]
    keys: list[str]  # its state dict's keys, in order
    adapters: dict[str, dict[str, str]]  # PEFT adapter -> its tensors' canonical keys -> the keys PEFT saves


def _held(weights: Weights, root: torch.nn.Module, buffers: list[tuple[str, Shape]], keys: list[str],
          params: list[tuple[str, torch.Tensor]]) -> _Held:
    ids: dict[int, list[str]] = {}
    for name, p in params:
        ids.setdefault(id(p), []).append(name)
    tied_keys = dict(getattr(root, "all_tied_weights_keys", None) or {})
    return _Held(list(weights.param_shapes().items()), [names for names in ids.values() if len(names) > 1], buffers,
                 tied_keys, keys, _adapter_keys(root))


def _adapter_keys(root: torch.nn.Module) -> dict[str, dict[str, str]]:
    """Each PEFT adapter's saved keys (``saved_key_map``) on this stage, where ``root`` is a PEFT model: an adapter
    checkpoint's keys for another stage's layers are known by them."""
    configs = getattr(root, "peft_config", None)
    out: dict[str, dict[str, str]] = {}
    for name in configs if isinstance(configs, dict) else ():
        try:
            out[name] = saved_key_map(root, name)
        except UnsupportedModelError:
            pass  # PEFT computes this adapter's tensors: a save or load of it is refused where it is asked for
    return out


def _merged(lists: list[list[str]]) -> list[str]:
    """Each name once, in the whole model's order: the first list's, then each later list's new names where that
    list puts them. A run of new names between two known ones (another expert-parallel rank's experts within a
    layer every rank holds) goes before the known name that follows it; a run with no known name before it (a
    later stage's layers) goes at the end."""
    order: list[str] = []
    known: set[str] = set()
    for names in lists:
        run: list[str] = []
        before: str | None = None  # the last known name seen in this list
        for name in [*names, None]:
            if name is not None and name not in known:
                run.append(name)
                continue
            if run:
                at = len(order)
                if name is not None and before is not None and order.index(name) > order.index(before):
                    at = order.index(name)
                order[at:at] = run
                known.update(run)
                run = []
            before = name
    return order


class StagePlan:
    """Which stage owns each tensor of the whole model, and the order every stage walks them in.

    ``order``: every parameter name of the whole model, stage by stage (each stage's own names in its own
    order, names an earlier stage holds left out). ``tensor_of``: name -> the tensor it is (names tied on
    any stage are one tensor). ``owner``: tensor -> the first stage holding one of its names.
    """

    def __init__(self, stage: Stage, held: list[_Held]) -> None:
        self.stage = stage
        parent: dict[str, str] = {}

        def find(name: str) -> str:
            while parent.setdefault(name, name) != name:
                name = parent[name]
            return name

        for h in held:
            for names in h.ties:
                for other in names[1:]:
                    parent[find(other)] = find(names[0])
        self.shapes: dict[str, Shape] = {}
        self.owner: dict[str, int] = {}  # tensor (its first name) -> stage
        self.tensor_of: dict[str, str] = {}
        for s, h in enumerate(held):
            for name, shape in h.names:
                if name in self.shapes:
                    continue
                self.shapes[name] = shape
                self.tensor_of[name] = find(name)
                self.owner.setdefault(find(name), s)
        self.order: list[str] = _merged([[name for name, _ in h.names] for h in held])
        # Persistent buffers (a router's bias in a layer): each from the first stage holding it.
        self.buffer_shapes: dict[str, Shape] = {}
        self.buffer_owner: dict[str, int] = {}
        for s, h in enumerate(held):
            for name, shape in h.buffers:
                self.buffer_shapes.setdefault(name, shape)
                self.buffer_owner.setdefault(name, s)
        # The whole model's state dict keys in its order: the stages hold consecutive modules.
        self.keys = _merged([h.keys for h in held])
        # The whole model's tie map, for its Hub layout: the same on every stage.
        self.tied_keys: dict[str, str] = {k: v for h in held for k, v in h.tied_keys.items()}
        self.adapter_keys: dict[str, dict[str, str]] = {}
        for h in held:
            for adapter, keys in h.adapters.items():
                self.adapter_keys.setdefault(adapter, {}).update(keys)
        self.names_of: dict[str, list[str]] = {}
        for name in self.order:
            self.names_of.setdefault(self.tensor_of[name], []).append(name)

    @classmethod
    def read(cls, stage: Stage, weights: Weights, root: torch.nn.Module, buffers: list[tuple[str, Shape]],
             keys: list[str], params: list[tuple[str, torch.Tensor]]) -> StagePlan:
        """Collective over the pipeline group: every stage says what it holds (``params``: its parameters under
        the whole model's names, a tied one under each)."""
        mine = _held(weights, root, buffers, keys, params)
        every: list[Any] = [None] * stage.stages
        dist.all_gather_object(every, mine, group=stage.group)
        return cls(stage, [_Held(*h) for h in every])

    def global_rank(self, s: int) -> int:
        return dist.get_global_rank(self.stage.group, s)

    def tensors(self) -> Iterator[tuple[str, int]]:
        """(tensor, owning stage) once each, in the order every stage walks them."""
        seen: set[str] = set()
        for name in self.order:
            t = self.tensor_of[name]
            if t not in seen:
                seen.add(t)
                yield t, self.owner[t]


def _plan_of(model: Adapter) -> StagePlan | None:
    """The plan of ``model``'s stages, or None where it is no pipeline stage."""
    weights = model.weights
    return weights.plan if isinstance(weights, StageWeights) else None


def layout_of(model: Adapter, strict: bool = True) -> Layout | None:
    """The Hub layout of ``model``: its backend's own (``Adapter.hub_layout``), else ``HubLayout.of`` its
    innermost model, with the whole model's tie map where it is a pipeline stage (transformers keeps that map
    on the last stage only). ``strict=False``: None where the backend's own layout refuses the model (a load
    of a checkpoint in the model's own names needs none)."""
    try:
        own = model.hub_layout()
    except UnsupportedModelError:
        if strict:
            raise
        return None
    if own is not None:
        return own  # type: ignore[no-any-return]
    plan = _plan_of(model)
    return HubLayout.of(model.unwrap(keep_peft=False), plan.tied_keys if plan is not None else None)


def stage_parts(model: Adapter, parts: Parts, plan: StagePlan) -> Parts:
    """``parts`` of a stage's own layers, with the whole model's names, counts and exports. The inner likeness
    is dropped: a copy of a stage is split the way its producer splits one, which the adapter says."""
    weights = StageWeights(parts.weights, plan, model)
    return parts.replace(weights=weights, gatherer=StageGatherer(parts.gatherer, weights, plan, model),
                         likeness=None)


class StageWeights:
    def __init__(self, inner: Weights, plan: StagePlan, model: Adapter) -> None:
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

    def __init__(self, inner: Gatherer, weights: Weights, plan: StagePlan, model: Adapter) -> None:
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
                value = _broadcast(plan, s, mine, plan.shapes[t], dtypes[s][t], self.model.device)
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


def stage_buffers(model: Adapter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every persistent buffer of the whole model (``model.named_live(parameters=False)`` where it is not a
    pipeline stage). Collective on a stage: each buffer comes from the first stage that holds it."""
    plan = _plan_of(model)
    if plan is None:
        yield from model.named_live(parameters=False)
        return
    me = plan.stage.number
    local = dict(model.named_live(parameters=False))
    dtypes = _exchange(plan, {n: _dtype_name(local[n]) for n, s in plan.buffer_owner.items() if s == me})
    for name, s in plan.buffer_owner.items():
        value = _broadcast(plan, s, local.get(name) if s == me else None, plan.buffer_shapes[name], dtypes[s][name],
                           model.device)
        yield name, value


def stage_adapter_keys(model: Adapter, adapter: str) -> dict[str, str]:
    """Canonical key -> saved key of PEFT adapter ``adapter`` on every stage, as they were when the model was
    adapted; empty where ``model`` is no pipeline stage."""
    plan = _plan_of(model)
    return dict(plan.adapter_keys.get(adapter, {})) if plan is not None else {}


def is_stage(model: Adapter) -> bool:
    """Whether ``model`` is one stage of a pipeline (its exports walk every stage's tensors)."""
    return _plan_of(model) is not None


def every_stage(model: Adapter, mine: Any) -> list[Any] | None:
    """Every stage's ``mine`` (a picklable value), in stage order: a collective over the pipeline group, entered
    by every rank of a stage alike. None where ``model`` is no pipeline stage (nothing exchanged)."""
    plan = _plan_of(model)
    if plan is None:
        return None
    every: list[Any] = [None] * plan.stage.stages
    dist.all_gather_object(every, mine, group=plan.stage.group)
    return every


def state_keys(model: Adapter) -> list[str]:
    """The keys of the whole model's state dict, in its order; nothing gathered."""
    plan = _plan_of(model)
    return list(plan.keys) if plan is not None else [name for name, _ in model.named_live()]


def buffer_shapes(model: Adapter) -> dict[str, Shape]:
    """Name -> shape of every persistent buffer of the whole model; nothing gathered."""
    plan = _plan_of(model)
    if plan is not None:
        return dict(plan.buffer_shapes)
    return {name: tuple(b.shape) for name, b in model.named_live(parameters=False)}


def _exchange(plan: StagePlan, mine: dict[str, str]) -> list[dict[str, str]]:
    """Every stage's ``mine`` (name -> dtype of what it sends), in stage order."""
    every: list[Any] = [None] * plan.stage.stages
    dist.all_gather_object(every, mine, group=plan.stage.group)
    return every


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _broadcast(plan: StagePlan, owner: int, value: torch.Tensor | None, shape: Shape, dtype: str,
               device: torch.device) -> torch.Tensor:
    """``value`` on the ``owner`` stage (returned as it is there), a copy of it received everywhere else."""
    # gloo moves CPU tensors only; NCCL moves them on the model's device.
    comm = torch.device("cpu") if dist.get_backend(plan.stage.group) == "gloo" else device
    if value is not None:
        sent = value.detach().to(comm).contiguous()
    else:
        sent = torch.empty(shape, dtype=getattr(torch, dtype), device=comm)
    dist.broadcast(sent, src=plan.global_rank(owner), group=plan.stage.group)
    return value.detach() if value is not None else sent


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

