"""Wrapping a module the way a policy is wrapped: per-block FSDP1/FSDP2 with the policy's
group or mesh and mixed precision, a DeepSpeed inference engine from the policy engine's
config, or the bare module on the policy's device in its compute dtype. Used for references
(``prepare_reference``) and by the trainer drop-ins (``integrations``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ._errors import ReferenceModelError
from ._imports import require
from ._registry import as_adapter
from .adapters import Adapter

__all__ = [
    "bare_module", "wrap_like", "block_classes", "fully_shard_per_block", "fsdp1_like", "wrap_fsdp1", "fsdp2_like",
    "shard_fsdp2", "reference_ds_config", "inference_ds_config", "engine_dtype", "config_dtype",
]


def bare_module(ref: Adapter, backend: str) -> torch.nn.Module | Adapter:
    """What wrapping ``ref`` the ``backend`` way starts from: the module itself, unwrapped from a
    replicated wrapper (which adds nothing to a frozen model); or ``ref`` when it is already
    wrapped that way. Any other wrapper is refused."""
    if ref.backend in ("dp", "ddp"):
        return ref.unwrap(keep_peft=True)
    if ref.backend == "plain":
        return ref.module
    if ref.backend == backend:
        return ref
    raise ReferenceModelError(
        f"ref_model is wrapped in {ref.backend} but the policy uses {backend}; pass the unwrapped "
        "model and it is sharded the policy's way."
    )


def wrap_like(pol: Adapter, ref_model: Any, ds_config: dict[str, Any] | None) -> Adapter:
    backend = pol.backend
    module = bare_module(as_adapter(ref_model, "using it as a reference"), backend)
    if isinstance(module, Adapter):
        return module
    device = pol.device
    if backend == "deepspeed":
        if (pol.zero_stage or 0) == 3:
            deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
            engine, *_ = deepspeed.initialize(model=module, config=reference_ds_config(pol, ds_config),
                                              mpu=policy_mpu(pol))
            return as_adapter(engine)
        dtype = engine_dtype(pol, ds_config)
        return as_adapter(module.to(device=device, dtype=dtype))
    if backend == "fsdp":
        return fsdp1_like(pol, module, init_on=None)
    if backend == "fsdp2":
        module.to(device)
        return fsdp2_like(pol, module)
    return as_adapter(module.to(device))


def block_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """Transformer block classes from ``_no_split_modules``; empty means "the root alone"."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def fully_shard_per_block(module: torch.nn.Module, mesh: Any, **kwargs: Any) -> torch.nn.Module:
    """FSDP2 the usual way: ``fully_shard`` each transformer block, then the root."""
    from torch.distributed.fsdp import fully_shard

    block_types = tuple(block_classes(module))
    for m in list(module.modules()):
        if block_types and isinstance(m, block_types):
            fully_shard(m, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


def fsdp1_like(pol: Adapter, module: torch.nn.Module, init_on: torch.device | None) -> Adapter:
    root: Any = pol.backend_object
    groups: dict[str, Any] = {"process_group": pol.process_group()}
    replicas = pol.replica_groups()
    if replicas:
        # HYBRID_SHARD takes its two groups together: the mesh it was given, or (shard, replicate).
        mesh = getattr(root, "_device_mesh", None)
        groups = {"device_mesh": mesh} if mesh is not None else {"process_group": (groups["process_group"], *replicas)}
    return wrap_fsdp1(
        module,
        device=pol.device,
        sharding_strategy=getattr(root, "sharding_strategy", None),
        mixed_precision=getattr(root, "mixed_precision", None),
        init_on=init_on,
        **groups,
    )


def wrap_fsdp1(module: torch.nn.Module, *, device: torch.device, init_on: torch.device | None = None,
               embedding_units: bool = True, **fsdp_kwargs: Any) -> Adapter:
    """FSDP1 for a frozen model: one unit per transformer block, on ``device``; with
    ``embedding_units`` also one per untied input/output embedding (see ``_fsdp1_wrap_policy``).
    ``init_on``: ``module`` is a meta skeleton to materialise there unit by unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if init_on is not None:
        # Meta skeleton: each unit gets real (uninitialised) storage only as it is sharded.
        fsdp_kwargs["param_init_fn"] = lambda m: m.to_empty(device=init_on, recurse=False)
    wrapped = FullyShardedDataParallel(
        module,
        auto_wrap_policy=_fsdp1_wrap_policy(module, block_classes(module), embedding_units),
        device_id=device,
        use_orig_params=True,
        **fsdp_kwargs,
    )
    return as_adapter(wrapped)


def _fsdp1_wrap_policy(module: torch.nn.Module, blocks: set[type[torch.nn.Module]], embedding_units: bool) -> Any:
    """Blocks, and with ``embedding_units`` untied input/output embeddings, each their own unit.

    FSDP1 leaves the root unit's parameters gathered after a forward without backward,
    which for a reference model is every forward; embeddings and head are the largest
    parameters outside the blocks, so giving them units keeps the reference sharded.
    (Tied embeddings must share a unit, so they stay in the root.)"""
    import functools

    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    get_in = getattr(module, "get_input_embeddings", None)
    get_out = getattr(module, "get_output_embeddings", None)
    extra: set[int] = set()
    emb_in = get_in() if callable(get_in) else None
    emb_out = get_out() if callable(get_out) else None
    if embedding_units and isinstance(emb_in, torch.nn.Module) and isinstance(emb_out, torch.nn.Module):
        if getattr(emb_in, "weight", None) is not getattr(emb_out, "weight", None):
            extra = {id(emb_in), id(emb_out)}
    if not blocks and not extra:
        return None
    kinds = tuple(blocks)

    def wrap(m: torch.nn.Module) -> bool:
        return (bool(kinds) and isinstance(m, kinds)) or id(m) in extra

    return functools.partial(lambda_auto_wrap_policy, lambda_fn=wrap)


def fsdp2_like(pol: Adapter, module: torch.nn.Module) -> Adapter:
    root: Any = pol.backend_object
    state = root._get_fsdp_state() if hasattr(root, "_get_fsdp_state") else None
    kwargs: dict[str, Any] = {}
    mp = getattr(state, "_mp_policy", None)
    if mp is not None:
        kwargs["mp_policy"] = mp
    return shard_fsdp2(module, pol.mesh(), **kwargs)


def shard_fsdp2(module: torch.nn.Module, mesh: Any, **kwargs: Any) -> Adapter:
    """FSDP2 for a frozen model: ``fully_shard`` per block, then the root, resharded after every forward."""
    fully_shard_per_block(module, mesh, **kwargs)
    # FSDP2 keeps the root's parameters gathered after forward, for the backward that a
    # frozen reference never runs: give that memory back after every forward.
    module.register_forward_hook(_reshard_root)
    return as_adapter(module)


def _reshard_root(module: Any, args: Any, output: Any) -> None:
    module.reshard()


# -- DeepSpeed configuration ----------------------------------------------------------------
def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def policy_mpu(pol: Adapter) -> Any:
    """The model-parallel unit the policy's engine was given (its data-parallel group is a
    sub-group then), or None: a reference engine must be set up over the same groups."""
    return getattr(pol.backend_object, "mpu", None)


def reference_ds_config(pol: Adapter, overrides: dict[str, Any] | None) -> dict[str, Any]:
    engine: Any = pol.backend_object
    raw = getattr(engine, "config", None)
    if not isinstance(raw, dict):
        raw = getattr(getattr(engine, "_config", None), "_param_dict", {})
    return inference_ds_config(raw, overrides)


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


def engine_dtype(pol: Adapter, overrides: dict[str, Any] | None) -> torch.dtype:
    """The engine's compute dtype (what its forward runs in), ``ds_config`` overriding."""
    engine: Any = pol.backend_object
    chosen = config_dtype(overrides or {})
    if chosen is not None:
        return chosen
    if callable(getattr(engine, "bfloat16_enabled", None)) and engine.bfloat16_enabled():
        return torch.bfloat16
    if callable(getattr(engine, "fp16_enabled", None)) and engine.fp16_enabled():
        return torch.float16
    return torch.float32


def config_dtype(cfg: Mapping[str, Any]) -> torch.dtype | None:
    """The compute dtype a DeepSpeed config enables, or ``None`` if it enables neither half type."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = cfg.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return dtype
    return None
