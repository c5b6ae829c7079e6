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

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ..._errors import UnsupportedModelError
from ..._imports import lookup
from ...formats.hooks import Chained, HookLayout
from ...formats.hub import HubLayout, Layout
from ...formats.mapped import given_layout
from ...formats.torchtitan import titan_layout
from ...layers.peft import saved_key_map
from ..core.foreign import CUT_STAGE, TRANSFORMERS_STAGES
from ..core.parts import Weights
from .hooks import HookGroup, StageHooks, own_hook_groups

if TYPE_CHECKING:
    from ..core.primitives import AdapterView

__all__ = ["Stage", "StagePlan", "plan_of", "recorded_stage", "adopt_torch_stage", "record", "buffer_shapes",
           "state_keys", "is_stage", "transformers_stage", "layout_of", "every_stage", "stage_adapter_keys",
           "state_hooks"]

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
    hooks: dict[str, tuple[list[str], list[tuple[str, Shape]]]]  # its hooked modules (``own_hook_groups``)


def _held(weights: Weights, root: torch.nn.Module, buffers: list[tuple[str, Shape]], keys: list[str],
          params: list[tuple[str, torch.Tensor]]) -> _Held:
    ids: dict[int, list[str]] = {}
    for name, p in params:
        ids.setdefault(id(p), []).append(name)
    tied_keys = dict(getattr(root, "all_tied_weights_keys", None) or {})
    shapes = weights.param_shapes()
    return _Held(list(shapes.items()), [names for names in ids.values() if len(names) > 1], buffers,
                 tied_keys, keys, _adapter_keys(root), own_hook_groups(root, {**shapes, **dict(buffers)}))


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
        # The model's own state-dict hooks, each run where its module is (``hooks.py``).
        self.hook_groups = {prefix: HookGroup(s, members, state) for s, h in enumerate(held)
                            for prefix, (members, state) in h.hooks.items()}
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

    def broadcast(self, owner: int, value: torch.Tensor | None, shape: Shape, dtype: str,
                  device: torch.device) -> torch.Tensor:
        """``value`` on the ``owner`` stage (returned as it is there), a copy of it received everywhere else."""
        # gloo moves CPU tensors only; NCCL moves them on the model's device.
        comm = torch.device("cpu") if dist.get_backend(self.stage.group) == "gloo" else device
        if value is not None:
            sent = value.detach().to(comm).contiguous()
        else:
            sent = torch.empty(shape, dtype=getattr(torch, dtype), device=comm)
        dist.broadcast(sent, src=self.global_rank(owner), group=self.stage.group)
        return value.detach() if value is not None else sent

    def tensors(self) -> Iterator[tuple[str, int]]:
        """(tensor, owning stage) once each, in the order every stage walks them."""
        seen: set[str] = set()
        for name in self.order:
            t = self.tensor_of[name]
            if t not in seen:
                seen.add(t)
                yield t, self.owner[t]


def plan_of(model: AdapterView) -> StagePlan | None:
    """The plan of ``model``'s stages, or None where it is no pipeline stage."""
    # A stage's weights part carries its plan (parts.py's StageWeights); read by duck type, so that the plan
    # does not import the parts built on it.
    plan = getattr(model.weights, "plan", None)
    return plan if isinstance(plan, StagePlan) else None


def layout_of(model: AdapterView, strict: bool = True) -> Layout | None:
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
    plan = plan_of(model)
    inner = model.unwrap(keep_peft=False)
    # A layout given to the model first; else transformers' (read from transformers) or torchtitan's (its own
    # state-dict adapter).
    hub: Layout | None = given_layout(inner) or HubLayout.of(inner, plan.tied_keys if plan is not None else None) or \
        titan_layout(inner)
    # The model's own state-dict hooks come first (its state dict is what the Hub layout converts).
    hooks = state_hooks(model, merged=True)
    if hooks is None:
        return hub
    return hooks if hub is None else Chained(hooks, hub)


def state_hooks(model: AdapterView, merged: bool = False) -> HookLayout | StageHooks | None:
    """The model's own state-dict hooks (``formats.hooks``) over the tree its names are relative to: the base
    model's where LoRA is merged, else the unwrapped model's; on a pipeline stage, every stage's. None where
    none has hooks, or where the backend names the tensors itself (its own Hub layout: Megatron-Core's)."""
    try:
        if model.hub_layout() is not None:
            return None
    except UnsupportedModelError:
        return None
    local = HookLayout.of(model.unwrap(keep_peft=not merged))
    plan = plan_of(model)
    if plan is None or not plan.hook_groups:
        return local
    return StageHooks(plan, local, model.device)


def stage_adapter_keys(model: AdapterView, adapter: str) -> dict[str, str]:
    """Canonical key -> saved key of PEFT adapter ``adapter`` on every stage, as they were when the model was
    adapted; empty where ``model`` is no pipeline stage."""
    plan = plan_of(model)
    return dict(plan.adapter_keys.get(adapter, {})) if plan is not None else {}


def is_stage(model: AdapterView) -> bool:
    """Whether ``model`` is one stage of a pipeline (its exports walk every stage's tensors)."""
    return plan_of(model) is not None


def every_stage(model: AdapterView, mine: Any) -> list[Any] | None:
    """Every stage's ``mine`` (a picklable value), in stage order: a collective over the pipeline group, entered
    by every rank of a stage alike. None where ``model`` is no pipeline stage (nothing exchanged)."""
    plan = plan_of(model)
    if plan is None:
        return None
    every: list[Any] = [None] * plan.stage.stages
    dist.all_gather_object(every, mine, group=plan.stage.group)
    return every


def state_keys(model: AdapterView) -> list[str]:
    """The keys of the whole model's state dict, in its order; nothing gathered."""
    plan = plan_of(model)
    return list(plan.keys) if plan is not None else [name for name, _ in model.named_live()]


def buffer_shapes(model: AdapterView) -> dict[str, Shape]:
    """Name -> shape of every persistent buffer of the whole model; nothing gathered."""
    plan = plan_of(model)
    if plan is not None:
        return dict(plan.buffer_shapes)
    return {name: tuple(b.shape) for name, b in model.named_live(parameters=False)}
