"""A model split into pipeline stages, one per rank, each holding its own layers whole under the whole
model's names.

Two producers: transformers (``DistributedConfig(pp_size=...)``) keeps a ``PipelineIdentityLayer`` in place
of every other stage's layer and runs its forward on every rank together; ``torch.distributed.pipelining``
(as torchtitan cuts a model: layers in a ``ModuleDict`` under their global numbers, the ends of the other
stages set to None) runs the stage in a schedule. Nothing changes the model's class, so it is known by its
stage: the one transformers records on it (``_pp_stage``), or the ``PipelineStage`` passed to ``adapt()``.
Its parts are those of whole tensors, wrapped by the stage parts (``stages/plan.py``): exports gather every
stage's tensors, loads fill each stage's own layers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch

from .._errors import UnsupportedModelError
from .core.base import Adapter
from .core.foreign import CUT_STAGE, TRANSFORMERS_STAGES
from .core.parts import Parts
from .core.recipes import Recipe, Setting, whole
from .core.topology import Topology
from .core.whole import whole_parts
from .stages.parts import stage_parts
from .stages.plan import Stage, StagePlan, record, recorded_stage

__all__ = ["PipelineAdapter", "over_stages", "STAGED_BACKENDS"]

# The backends a torch.distributed.pipelining stage may sit in, read as stages of theirs: each shards or
# replicates within one stage, and the stages are a dimension around it (torchtitan's (pp, dp) meshes).
STAGED_BACKENDS = ("fsdp2", "ddp")


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    import torch.distributed as dist

    return split_into_stages(whole(model, setting), dist.group.WORLD, setting.device)


def split_into_stages(module: torch.nn.Module, group: Any, device: torch.device) -> torch.nn.Module:
    """``module`` (a transformers model, or a PEFT model around one) split into one stage per rank of ``group``
    as ``DistributedConfig(pp_size=...)`` splits one: each rank keeps its own layers and replaces the others.
    The forward transformers installs runs the model itself, so a copy that has one gets its own."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism

    peft_base = getattr(module, "get_base_model", None)
    base = peft_base() if callable(peft_base) else module
    base.__dict__.pop("forward", None)
    base.__dict__.pop("_pp_forward_wrapped", None)
    apply_pipeline_parallelism(base, DeviceMesh.from_group(group, device.type, mesh_dim_names=("pp",)))
    return module


class PipelineAdapter(Adapter):
    name = "pipeline"
    recipe = Recipe(("pipeline",), _build, order=10, needs="transformers.distributed.pipeline_parallel")
    peels = False
    distributed = True
    # The partitioning this adapter reads; ``adapt()`` refuses any other (``core/foreign.py``).
    reads_marks: ClassVar[tuple[str, ...]] = (TRANSFORMERS_STAGES, CUT_STAGE)

    @classmethod
    def claims(cls, module: torch.nn.Module) -> bool:
        """Whether ``module`` (no wrapper around it) is one stage of a pipeline."""
        return recorded_stage(module) is not None

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        return obj

    @functools.cached_property
    def _stage(self) -> Stage:
        stage = recorded_stage(self._innermost)
        assert stage is not None  # claimed for it
        return stage

    def topology(self) -> Topology:
        # One rank per stage, and no other parallelism: the group is the pipeline, and it shares one batch.
        return Topology(self._stage.group, (), None, pp_group=self._stage.group)

    @property
    def is_sharded(self) -> bool:
        return True  # each rank holds some of the layers

    def parts(self) -> Parts:
        inner = whole_parts(self)
        return stage_parts(self, inner, _plan(self, inner)).replace(likeness=_PipelineLikeness(self))


_STAGED: dict[type[Adapter], type[Adapter]] = {}


def over_stages(backend: type[Adapter]) -> type[Adapter]:
    """``backend``'s adapter for a model that is one pipeline stage of a torch.distributed.pipelining
    schedule: its parts within the stage, wrapped in the stage parts, and the stages a group around its own."""
    if backend not in _STAGED:
        _STAGED[backend] = _staged(backend)
    return _STAGED[backend]


def _staged(backend: type[Adapter]) -> type[Adapter]:
    if backend.name not in STAGED_BACKENDS:
        raise UnsupportedModelError(
            f"this {backend.name} model is one stage of a pipeline (torch.distributed.pipelining), and wrapkit reads "
            f"stages beside {' or '.join(STAGED_BACKENDS)} only; shard each stage with fully_shard() or wrap it in "
            "DistributedDataParallel.")

    class Staged(backend):  # type: ignore[misc, valid-type]
        reads_marks: ClassVar[tuple[str, ...]] = (CUT_STAGE,)

        @functools.cached_property
        def _stage(self) -> Stage:
            # Recorded on the stage's module: the model itself under FSDP2, the wrapper under DDP.
            stage = recorded_stage(self._module) or recorded_stage(self._innermost)
            assert stage is not None  # composed for it
            return stage

        def topology(self) -> Topology:
            # The backend's own groups within a stage; the stages are one more dimension around them.
            within: Topology = super().topology()
            return within.within_stages(self._stage.group)

        def parts(self) -> Parts:
            # The model inside the wrapper is the same stage (a frozen copy of a DDP stage keeps it alone).
            record(self._innermost, self._stage)
            inner = super().parts()
            plan = _plan(self, inner)
            return stage_parts(self, inner, plan).replace(
                likeness=_StagedLikeness(inner, self._stage, copies_module=self.name == "ddp"))

        def frozen_form(self) -> Adapter:
            form: Adapter = super().frozen_form()
            if form is self:
                return self
            # DDP's frozen copy is the stage's module alone: a pipeline of its own over the same stages.
            return PipelineAdapter(form.module, [*form._entries, (PipelineAdapter.name, form._innermost)], None,
                                   form._innermost)

    Staged.__name__ = Staged.__qualname__ = f"Staged{backend.__name__}"
    return Staged


def _plan(model: Adapter, inner: Parts) -> StagePlan:
    buffers = [(name, tuple(b.shape)) for name, b in model.named_live(parameters=False)]
    keys = [name for name, _ in model.named_live()]
    params = list(model.named_live(buffers=False))
    return StagePlan.read(model._stage, inner.weights, model.unwrap(), buffers, keys,  # type: ignore[attr-defined]
                          params)


class _StagedLikeness:
    """Copies of a stage inside another backend. A replicated one's (DDP) is the stage's module copied, a
    pipeline of its own over the same stages. An FSDP2 one's (sharded, or over one rank as torchtitan's stages
    without data parallelism are) would be rebuilt whole from the config, which this stage was cut from by code
    wrapkit cannot repeat: refused, as is wrapping a module another way."""

    takes_config = False
    own_ops = False

    def __init__(self, inner: Parts, stage: Stage, copies_module: bool) -> None:
        self.inner, self.stage, self.copies_module = inner.likeness, stage, copies_module

    def start(self) -> torch.nn.Module | None:
        return None  # a reference passed in is used as it is when cut and wrapped as the policy is

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        raise UnsupportedModelError(_CUT_BY_HAND)

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        if not self.copies_module or self.inner is None:
            raise UnsupportedModelError(_CUT_BY_HAND)
        clone = self.inner.copy(ds_config)
        record(clone, self.stage)
        return clone


_CUT_BY_HAND = (
    "a torch.distributed.pipelining stage is cut by the code that built it, which wrapkit cannot repeat on another "
    "module; cut the reference the same way, wrap it as the policy is, and pass its PipelineStage as ref_model")


class _PipelineLikeness:
    """Copies split into the same stages: transformers' own split applied again over the same group, or a
    copy of a ``torch.distributed.pipelining`` stage's module recorded at the same place."""

    takes_config = False
    own_ops = False

    def __init__(self, model: PipelineAdapter) -> None:
        self.model = model

    def start(self) -> torch.nn.Module | None:
        return None  # a stage lacks the other stages' layers: a copy wrapped another way has nothing to start from

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        if self.model._stage.producer != TRANSFORMERS_STAGES:
            raise UnsupportedModelError(
                "a torch.distributed.pipelining stage is cut by the code that built it, which wrapkit cannot repeat "
                "on another module; cut the reference the same way and pass its PipelineStage, or use "
                "prepare_reference(policy) for a copy of this stage")
        return self._staged(module.to(self.model.device))

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        source = self.model.unwrap(keep_peft=True)
        if self.model._stage.producer != TRANSFORMERS_STAGES:
            clone = copy.deepcopy(source)
            record(clone, self.model._stage)
            return clone
        # The stage object holds the process group, which cannot be copied: the copy shares it until split again.
        held = getattr(self.model._innermost, "_pp_stage", None)
        return self._staged(copy.deepcopy(source, memo={id(held): held}))

    def _staged(self, module: torch.nn.Module) -> torch.nn.Module:
        return split_into_stages(module, self.model._stage.group, self.model.device)
