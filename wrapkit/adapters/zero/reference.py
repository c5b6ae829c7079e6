"""A DeepSpeed policy's reference: an inference config derived from the engine's training config,
the engine's compute dtype, and a ZeRO-3 copy filled partition to partition."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._agree import any_over_models
from ..._imports import require
from ..core.likeness import copy_buffers, skeleton
from .partitions import settle_gathers

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["inference_ds_config", "config_dtype", "reference_config", "engine_dtype", "zero3_copy"]


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def inference_ds_config(raw: Mapping[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A training config minus what only training needs (optimizer, scheduler, optimizer
    offload), at ZeRO stage 3, with ``overrides`` merged over it."""
    cfg = copy.deepcopy(dict(raw))
    for key in ("optimizer", "scheduler"):
        cfg.pop(key, None)
    zero = dict(cfg.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    zero["stage"] = 3
    cfg["zero_optimization"] = zero
    return _deep_merge(cfg, overrides or {})


def config_dtype(cfg: Mapping[str, Any]) -> torch.dtype | None:
    """The compute dtype a DeepSpeed config enables, or ``None`` if it enables neither half type."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = cfg.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return dtype
    return None


def reference_config(engine: Any, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The inference config of a reference beside ``engine``: its own config, for inference."""
    raw = getattr(engine, "config", None)
    if not isinstance(raw, dict):
        raw = getattr(getattr(engine, "_config", None), "_param_dict", {})
    return inference_ds_config(raw, overrides)


def engine_dtype(engine: Any, overrides: dict[str, Any] | None) -> torch.dtype:
    """The engine's compute dtype (what its forward runs in), ``overrides`` (a ds_config) first."""
    chosen = config_dtype(overrides or {})
    if chosen is not None:
        return chosen
    if callable(getattr(engine, "bfloat16_enabled", None)) and engine.bfloat16_enabled():
        return torch.bfloat16
    if callable(getattr(engine, "fp16_enabled", None)) and engine.fp16_enabled():
        return torch.float16
    return torch.float32


def reference_engine(adapter: Adapter, module: torch.nn.Module, cfg: dict[str, Any]) -> torch.nn.Module:
    """A ZeRO-3 inference engine of ``module`` over the policy engine's groups (its ``mpu`` too: the
    data-parallel group is a sub-group then)."""
    deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
    engine, *_ = deepspeed.initialize(model=module, config=cfg, mpu=getattr(adapter.backend_object, "mpu", None))
    assert isinstance(engine, torch.nn.Module)
    return engine


def zero3_copy(adapter: Adapter, ds_config: dict[str, Any] | None) -> torch.nn.Module:
    """A frozen ZeRO-3 engine with the policy's weights, built inside ``zero.Init`` (never whole)."""
    deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
    cfg = reference_config(adapter.backend_object, ds_config)
    group = adapter.process_group()
    with deepspeed.zero.Init(config_dict_or_path=cfg, data_parallel_group=group):
        model = skeleton(adapter, initialise=False)  # every weight is copied from the policy below
    theirs = dict(adapter.unwrap(keep_peft=False).named_parameters())
    pairs: list[tuple[Any, Any]] = [(theirs[name], p) for name, p in model.named_parameters()]
    # Same group, same sizes: partitions line up and are copied locally. Agreed first, as
    # the fallback gathers (one parameter at a time).
    aligned = all(a.ds_tensor.shape == b.ds_tensor.shape for a, b in pairs)
    with torch.no_grad():
        if not any_over_models(not aligned, adapter):
            for a, b in pairs:
                b.ds_tensor.copy_(a.ds_tensor)
        else:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for a, b in pairs:
                with deepspeed.zero.GatheredParameters([a, b], modifier_rank=src):
                    settle_gathers([a, b])
                    if adapter.rank == 0:
                        b.data.copy_(a.data)
    engine = reference_engine(adapter, model, cfg)
    copy_buffers(adapter.unwrap(keep_peft=False), model)
    return engine
