"""DeepSpeed's ``DeepSpeedEngine`` at ZeRO stage 0-3 (its weights: ``zero/parts.py``).

``engine.config`` is DeepSpeed's own config dict, not the model's: the trap behind
failure #1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._imports import is_instance
from ..core.internals import ZERO3_PARAM, require_internals
from ..core.kinds import ShardedAdapter
from ..core.likeness import ShardedLikeness, replicated_copy
from ..core.parts import Parts
from ..core.recipes import Mpu, Recipe, Setting, ds_config
from ..core.topology import Topology
from ..core.whole import TorchStates
from .parts import zero_parts
from .reference import engine_dtype, reference_config, reference_engine, zero3_copy
from .resume import zero_resume
from .states import offload_engine_states, sleep_way


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    import deepspeed

    extra = {} if setting.half is None else {setting.precision: {"enabled": True}}
    mpu = Mpu() if setting.topology == "subgroup" else None
    if mpu is None:
        # DeepSpeed keeps the last engine's mpu process-wide (deepspeed.utils.groups.mpu) and
        # reads its groups from there: an engine after a sub-group one would inherit them.
        from deepspeed.utils import groups

        groups.mpu = None
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(int(layer[4:]), **extra), mpu=mpu)
    return engine  # type: ignore[no-any-return]


class DeepSpeedAdapter(ShardedAdapter):
    name = "deepspeed"
    distributed = True
    recipe = Recipe(("zero0", "zero1", "zero2", "zero3"), _build, order=5, topologies=frozenset({"subgroup"}),
                    needs="deepspeed")

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "deepspeed.runtime.engine", "DeepSpeedEngine")

    def _engine(self) -> Any:
        return self._backend_obj

    def topology(self) -> Topology:
        # The engine's data-parallel group: ZeRO partitions over it, or (stage 0) replicates.
        return Topology(getattr(self._engine(), "data_parallel_group", None), (), None)

    def _check_internals(self) -> None:
        if self.zero_stage == 3:
            require_internals(self._innermost.parameters(), ZERO3_PARAM, "ZeRO-3 parameters", "deepspeed")

    @property
    def device(self) -> torch.device:
        dev = getattr(self._engine(), "device", None)
        if isinstance(dev, torch.device):
            return dev
        if isinstance(dev, (str, int)):
            return torch.device(dev)
        return super().device

    @property
    def zero_stage(self) -> int | None:
        engine = self._engine()
        fn = getattr(engine, "zero_optimization_stage", None)
        return int(fn()) if callable(fn) else 0

    @property
    def is_sharded(self) -> bool:
        return self.zero_stage == 3 and self.world_size > 1

    def parts(self) -> Parts:
        # Without a way to move the engine's states (older DeepSpeed, or no optimizer), it has none.
        movable = sleep_way(self.zero_stage or 0, getattr(self._engine(), "optimizer", None)) is not None
        states = _EngineStates(self) if movable else None
        return zero_parts(self).replace(likeness=_EngineLikeness(self), states=states,
                                        resume=zero_resume(self, self._engine()))



class _EngineLikeness(ShardedLikeness["DeepSpeedAdapter"]):
    """A ZeRO-3 reference is an engine of its own, configured like the policy's; below ZeRO-3 the module
    alone, in the engine's compute dtype."""

    takes_config = True
    own_ops = True  # ZeRO-3 replaces torch functions process-wide; its engines run on them

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        model = self.model
        if model.zero_stage == 3:
            return reference_engine(model, module, reference_config(model._engine(), ds_config))
        return module.to(device=model.device, dtype=engine_dtype(model._engine(), ds_config))

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        model = self.model
        return zero3_copy(model, ds_config) if model.zero_stage == 3 else replicated_copy(model, self.wrap, ds_config)


class _EngineStates(TorchStates):
    """The engine's optimizer, whose fp32 masters and gradient partitions live in flat buffers of its own
    (outside the torch optimizer's ``state``), moved by DeepSpeed's ``offload_states``."""

    def __init__(self, model: DeepSpeedAdapter) -> None:
        self.model = model

    def own_optimizer(self) -> Any:
        return getattr(self.model._engine(), "optimizer", None)

    def tensors(self, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            for t in getattr(optimizer, attr, None) or ():
                yield "fp32 masters", t
        buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
        if isinstance(buffer, torch.Tensor):
            yield "gradient partitions", buffer
        yield from super().tensors(getattr(optimizer, "optimizer", optimizer))

    def offload(self, home: torch.device) -> Callable[[], None] | None:
        return offload_engine_states(self.model._engine(), self.model.zero_stage or 0, home)
