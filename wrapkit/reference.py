"""``prepare_reference``: the frozen reference model of DPO, online DPO, GRPO and PPO,
sharded and placed the way the policy is.

What a trainer used to get wrong, and what this module does instead:

* handing ``None`` to a backend (``deepspeed.initialize(model=None)``) when PEFT made a
  separate reference unnecessary: a ``None`` reference is built here, as a view of the
  policy with its adapters off or as a fresh frozen copy of its weights;
* "preparing" a reference in evaluation mode by skipping wrapping and placement: the
  reference here is always wrapped like the policy and verified on its compute device.

A fresh copy of a sharded policy is built as an empty skeleton that is sharded first and
filled from the policy's own shards (ZeRO-3 partitions, FSDP2 DTensors, FSDP1 sharded
state dict), so no rank ever holds the full model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._errors import ReferenceModelError
from ._imports import require
from ._names import canonical_name
from ._protocol import WrappedModel
from ._registry import as_adapter
from .adapters import Adapter
from .adapters._base import model_class_name
from .view import AdapterDisabledView, view_possible

__all__ = ["prepare_reference", "AdapterDisabledView", "block_classes", "fully_shard_per_block"]

_REPLICATED = ("plain", "dp", "ddp")


def prepare_reference(policy: Any, ref_model: Any = None, *,
                      ds_config: dict[str, Any] | None = None) -> WrappedModel:
    """A frozen reference for ``policy``, sharded and placed as the policy is. Call on every rank.

    ZeRO-3 gives a DeepSpeed inference engine at stage 3 (the policy's config without
    optimizer, scheduler and optimizer offload; ``ds_config`` is merged over it); ZeRO-0/1/2
    an unsharded module in the engine's compute dtype; FSDP1/FSDP2 a model wrapped per
    transformer block with the policy's group or mesh and mixed precision; DDP,
    DataParallel and plain the bare module. All on the policy's compute device.

    ``ref_model=None``: a PEFT policy whose only trainable parameters are its adapters gets an
    adapter-disabled view (no parameter memory); any other policy a fresh frozen copy of its
    current weights. A ``ref_model`` that is the policy or shares its parameters is refused
    with ``ReferenceModelError``.
    """
    pol = as_adapter(policy, "using it as the policy of another reference")
    if ds_config is not None and pol.backend != "deepspeed":
        raise ReferenceModelError(
            f"ds_config only applies to a DeepSpeed policy, and this policy's backend is {pol.backend!r}; "
            "drop ds_config."
        )
    if ref_model is not None:
        shared = _shares_parameters(pol, ref_model)
        if pol.agree_any(shared):
            raise ReferenceModelError(
                "ref_model is the policy or shares parameters with it, so it would train along with the "
                "policy; pass a separate model (e.g. loaded again from the same checkpoint) or None to "
                "let prepare_reference build one."
            )
        return _wrap_like(pol, ref_model, ds_config).to_eval_frozen()
    if view_possible(pol):
        return AdapterDisabledView(pol)
    return _fresh_copy(pol, ds_config).to_eval_frozen()


# -- identity checks -------------------------------------------------------------------------
def _storages(module: torch.nn.Module) -> Iterator[tuple[torch.device, int]]:
    for p in module.parameters():
        local = getattr(p, "_local_tensor", p)  # a DTensor's storage is its local shard's
        if isinstance(local, torch.Tensor) and local.numel() > 0 and not local.is_meta:
            yield local.device, local.untyped_storage().data_ptr()


def _shares_parameters(pol: Adapter, ref_model: Any) -> bool:
    ref = as_adapter(ref_model, "using it as a reference")
    if ref.module is pol.module or ref.unwrap(keep_peft=False) is pol.unwrap(keep_peft=False):
        return True
    pol_root = pol.unwrap(keep_peft=True)
    ref_root = ref.unwrap(keep_peft=True)
    if {id(p) for p in pol_root.parameters()} & {id(p) for p in ref_root.parameters()}:
        return True
    return bool(set(_storages(pol_root)) & set(_storages(ref_root)))


# -- wrapping a given module like the policy --------------------------------------------------
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


def _wrap_like(pol: Adapter, ref_model: Any, ds_config: dict[str, Any] | None) -> Adapter:
    backend = pol.backend
    module = bare_module(as_adapter(ref_model, "using it as a reference"), backend)
    if isinstance(module, Adapter):
        return module
    device = pol.device
    if backend == "deepspeed":
        if (pol.zero_stage or 0) == 3:
            deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
            engine, *_ = deepspeed.initialize(model=module, config=_reference_ds_config(pol, ds_config))
            return as_adapter(engine)
        dtype = _engine_dtype(pol, ds_config)
        return as_adapter(module.to(device=device, dtype=dtype))
    if backend == "fsdp":
        return _fsdp1_wrap(pol, module, init_on=None)
    if backend == "fsdp2":
        module.to(device)
        return _fsdp2_shard(pol, module)
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


def _fsdp1_wrap(pol: Adapter, module: torch.nn.Module, init_on: torch.device | None) -> Adapter:
    root: Any = pol.backend_object
    return wrap_fsdp1(
        module,
        device=pol.device,
        process_group=pol.process_group(),
        sharding_strategy=getattr(root, "sharding_strategy", None),
        mixed_precision=getattr(root, "mixed_precision", None),
        init_on=init_on,
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


def _fsdp2_shard(pol: Adapter, module: torch.nn.Module) -> Adapter:
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


def _reference_ds_config(pol: Adapter, overrides: dict[str, Any] | None) -> dict[str, Any]:
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


def _engine_dtype(pol: Adapter, overrides: dict[str, Any] | None) -> torch.dtype:
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


# -- fresh frozen copies ------------------------------------------------------------------------
def _skeleton(pol: Adapter) -> torch.nn.Module:
    """An uninitialised model of the policy's class, built from its config (weights come later)."""
    inner = pol.unwrap(keep_peft=False)
    cfg = getattr(inner, "config", None)
    if "peft" in pol.stack or cfg is None:
        why = ("its PEFT model trains weights outside the adapters" if "peft" in pol.stack
               else f"{model_class_name(inner)} has no config to rebuild it from")
        raise ReferenceModelError(
            f"cannot build a reference for this sharded {pol.backend} policy without gathering it, because {why}; "
            "pass ref_model (the model loaded again from its checkpoint)."
        )
    dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    model = type(inner)(copy.deepcopy(cfg))
    return model.to(dtype)


def _fresh_copy(pol: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    if pol.backend == "deepspeed" and pol.zero_stage == 3:
        return _zero3_copy(pol, ds_config)
    if pol.backend == "fsdp":
        return _fsdp1_copy(pol)
    if pol.backend == "fsdp2":
        return _fsdp2_copy(pol)
    # Replicated backends (and ZeRO-0/1/2) hold the full weights on every rank already.
    source = pol.unwrap(keep_peft=True)
    if any(p.numel() == 0 for p in source.parameters()):
        raise ReferenceModelError(
            f"the {pol.backend} policy's parameters are not all present on this rank (offloaded or sharded); "
            "call policy.place() first or pass ref_model."
        )
    return _wrap_like(pol, copy.deepcopy(source), ds_config)


def _copy_buffers(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Buffers are never sharded; non-persistent ones (rotary tables) are in no state dict."""
    theirs = {canonical_name(k): v for k, v in src.named_buffers()}
    with torch.no_grad():
        for name, buf in dst.named_buffers():
            other = theirs.get(canonical_name(name))
            if other is not None:
                buf.copy_(other)


def _fsdp2_copy(pol: Adapter) -> Adapter:
    with torch.device("meta"):
        model = _skeleton(pol)
    ref = _fsdp2_shard(pol, model)
    model.to_empty(device=pol.device)
    inner = pol.unwrap(keep_peft=False)
    unit: Any
    for unit in inner.modules():
        # FSDP2 leaves the root gathered after a forward; back to shards (what the next
        # forward starts from anyway) so that every parameter is a DTensor to copy from.
        if hasattr(unit, "reshard") and hasattr(unit, "_get_fsdp_state"):
            unit.reshard()
    theirs = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Same mesh and placements: a local copy of this rank's shard, nothing gathered.
            p.copy_(theirs[name])
    _copy_buffers(inner, model)
    return ref


def _fsdp1_copy(pol: Adapter) -> Adapter:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with torch.device("meta"):
        model = _skeleton(pol)
    ref = _fsdp1_wrap(pol, model, init_on=pol.device)
    src: Any = pol.backend_object
    dst: Any = ref.module
    # Sharded state dicts move shard to shard, one unit at a time: the full model is never built.
    with FullyShardedDataParallel.state_dict_type(src, StateDictType.SHARDED_STATE_DICT), \
            FullyShardedDataParallel.state_dict_type(dst, StateDictType.SHARDED_STATE_DICT):
        dst.load_state_dict(src.state_dict())
    _copy_buffers(pol.unwrap(keep_peft=False), ref.unwrap(keep_peft=False))
    return ref


def _zero3_copy(pol: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
    cfg = _reference_ds_config(pol, ds_config)
    group = pol.process_group()
    with deepspeed.zero.Init(config_dict_or_path=cfg, data_parallel_group=group):
        model = _skeleton(pol)
    theirs = dict(pol.unwrap(keep_peft=False).named_parameters())
    pairs: list[tuple[Any, Any]] = [(theirs[name], p) for name, p in model.named_parameters()]
    # Same group, same sizes: partitions line up and are copied locally. Agreed first, as
    # the fallback gathers (one parameter at a time).
    aligned = all(a.ds_tensor.shape == b.ds_tensor.shape for a, b in pairs)
    with torch.no_grad():
        if not pol.agree_any(not aligned):
            for a, b in pairs:
                b.ds_tensor.copy_(a.ds_tensor)
        else:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for a, b in pairs:
                with deepspeed.zero.GatheredParameters([a, b], modifier_rank=src):
                    if pol.rank == 0:
                        b.data.copy_(a.data)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    _copy_buffers(pol.unwrap(keep_peft=False), engine.module)
    return as_adapter(engine)
