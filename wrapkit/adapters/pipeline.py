"""A model split into pipeline stages, one per rank, each holding its own layers whole under the whole
model's names.

Two producers: transformers (``DistributedConfig(pp_size=...)``) keeps a ``PipelineIdentityLayer`` in place
of every other stage's layer and runs its forward on every rank together; ``torch.distributed.pipelining``
(as torchtitan cuts a model: layers in a ``ModuleDict`` under their global numbers, the ends of the other
stages set to None) runs the stage in a schedule. Nothing changes the model's class, so it is known by its
stage: the one transformers records on it (``_pp_stage``), or the ``PipelineStage`` passed to ``adapt()``.
Its parts are those of whole tensors, wrapped by the stage parts (``_stages.py``): exports gather every
stage's tensors, loads fill each stage's own layers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch

from .._errors import UnsupportedModelError
from ._base import Adapter
from ._foreign import CUT_STAGE, TRANSFORMERS_STAGES
from ._parts import Parts
from ._stages import Stage, StagePlan, record, recorded_stage, stage_parts
from ._topology import Topology
from ._whole import whole_parts

__all__ = ["PipelineAdapter"]


class PipelineAdapter(Adapter):
    name = "pipeline"
    peels = False
    distributed = True
    # The partitioning this adapter reads; ``adapt()`` refuses any other (``_foreign.py``).
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
        buffers = [(name, tuple(b.shape)) for name, b in self.named_live(parameters=False)]
        keys = [name for name, _ in self.named_live()]
        plan = StagePlan.read(self._stage, inner.weights, self.unwrap(), buffers, keys)
        return stage_parts(self, inner, plan).replace(likeness=_PipelineLikeness(self))


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
        """``module`` split as the model is. The forward transformers installed on the model runs the model
        itself, so a copy gets its own; the split keeps this stage's layers and replaces the others."""
        from torch.distributed.device_mesh import DeviceMesh
        from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism

        peft_base = getattr(module, "get_base_model", None)
        base = peft_base() if callable(peft_base) else module
        base.__dict__.pop("forward", None)
        base.__dict__.pop("_pp_forward_wrapped", None)
        mesh = DeviceMesh.from_group(self.model._stage.group, self.model.device.type, mesh_dim_names=("pp",))
        apply_pipeline_parallelism(base, mesh)
        return module
