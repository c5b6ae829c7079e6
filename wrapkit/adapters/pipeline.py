"""A model split into pipeline stages by transformers (``DistributedConfig(pp_size=...)``).

Each rank keeps its own decoder layers whole, under the whole model's names, and holds a
``PipelineIdentityLayer`` in place of every other stage's; the model's forward runs on every rank
together (activations passed stage to stage, logits broadcast from the last). Nothing changes the
model's class, so it is known by what it holds: the stage transformers records on it (``_pp_stage``).
Its parts are those of whole tensors, wrapped by the stage parts (``_stages.py``): exports gather every
stage's tensors, loads fill each stage's own layers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, ClassVar

import torch

from ._base import Adapter
from ._parts import Parts
from ._stages import Stage, StagePlan, stage_parts, transformers_stage
from ._topology import Topology
from ._whole import whole_parts

__all__ = ["PipelineAdapter"]


class PipelineAdapter(Adapter):
    name = "pipeline"
    peels = False
    distributed = True
    # The partitioning this adapter reads; ``adapt()`` refuses any other (``_foreign.py``).
    reads_marks: ClassVar[tuple[str, ...]] = ("transformers' DistributedConfig(pp_size=...)",)

    @classmethod
    def claims(cls, module: torch.nn.Module) -> bool:
        """Whether ``module`` (no wrapper around it) is one stage of transformers' pipeline."""
        return transformers_stage(module) is not None

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        return obj

    @functools.cached_property
    def _stage(self) -> Stage:
        stage = transformers_stage(self._innermost)
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
    """Copies split into the same stages: transformers' own split applied again, over the same group."""

    takes_config = False
    own_ops = False

    def __init__(self, model: PipelineAdapter) -> None:
        self.model = model

    def start(self) -> torch.nn.Module | None:
        return None  # a stage lacks the other stages' layers: a copy wrapped another way has nothing to start from

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        return self._staged(module.to(self.model.device))

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        source = self.model.unwrap(keep_peft=True)
        # The stage object holds the process group, which cannot be copied: the copy shares it until split again.
        record = getattr(self.model._innermost, "_pp_stage", None)
        return self._staged(copy.deepcopy(source, memo={id(record): record}))

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
