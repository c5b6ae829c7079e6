"""Drop-ins for TRL's model-preparation helpers, built on wrapkit.

Same names, signatures and return types as ``trl.models`` (``prepare_deepspeed``,
``prepare_fsdp``, ``unwrap_model_for_generation``), so a trainer changes one import.
What they add over TRL's own:

* a ``None`` model is refused with a ``ReferenceModelError`` that says what to do, instead of
  reaching ``deepspeed.initialize(model=None)`` (with PEFT there is often no separate reference:
  ``wrapkit.prepare_reference(policy)`` gives the adapter-disabled view);
* models come back in eval mode and verified on the accelerator's device, never left where
  they were loaded;
* FSDP2 references are sharded per transformer block and resharded after every forward, so
  blocks are gathered one by one during a forward and nothing stays gathered after it (TRL
  shards the root only, which gathers the whole model at once);
* ``unwrap_model_for_generation`` gathers FSDP1 and FSDP2 models too, runs ``generate()``
  outside the sharding hooks, and restores every submodule's training flag and the gradient
  checkpointing setting exactly, on every backend, also when generation raises.

``patch_trl()`` points TRL's own trainers (DPO, GRPO, RLOO, KTO, ...) at these functions.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._errors import ReferenceModelError
from .._gather import generation_modes, set_modes
from .._imports import require
from .._registry import as_adapter
from ..adapters import Adapter
from ..adapters.dtensor.sharding import shard_fsdp2
from ..adapters.flat.fsdp import wrap_fsdp1
from ..adapters.zero.reference import config_dtype, inference_ds_config
from ..references.placement import place
from ..references.wrapping import bare_module
from ._patch import Patch, swap, swap_methods
from ._trl_async import async_methods
from ._trl_online_dpo import online_dpo_methods
from ._trl_server import server_methods
from ._trl_sync import iter_named_params, prepared_policy, vllm_weights

__all__ = [
    "prepare_deepspeed", "prepare_fsdp", "unwrap_model_for_generation", "patch_trl", "TRLPatch",
    "deepspeed_for_inference", "check_model", "plugin_of", "DROP_INS", "vllm_weights",
]

# DeepSpeed tuning values that transformers/accelerate leave as "auto" until they see the model.
_HIDDEN_SIZED: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def prepare_deepspeed(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """``model`` prepared for inference next to the accelerator's DeepSpeed policy.

    ZeRO-3: a DeepSpeed inference engine at stage 3 from the accelerator's config (optimizer,
    scheduler and optimizer offload removed, ``"auto"`` sizes filled from the model's hidden
    size). ZeRO-0/1/2: the module itself, on the accelerator's device in the config's compute
    dtype, with no engine (it is replicated anyway). Either way in eval mode; ``requires_grad``
    is left as it is, as TRL does (it passes policies through here too). An engine is returned
    as is, in eval mode. Call on every rank.
    """
    check_model(model, "prepare_deepspeed")
    plugin = plugin_of(accelerator, "deepspeed_plugin", "DeepSpeed")
    return deepspeed_for_inference(model, plugin.deepspeed_config, accelerator.device)


def deepspeed_for_inference(model: torch.nn.Module, config: Mapping[str, Any], device: Any) -> torch.nn.Module:
    """``prepare_deepspeed``'s work for a given DeepSpeed ``config`` (the policy's training config)."""
    cfg = dict(copy.deepcopy(config))
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    module = bare_module(as_adapter(model), "deepspeed")
    if isinstance(module, Adapter):
        return _for_inference(module)
    ref: Adapter
    if stage == 3:
        deepspeed = require("deepspeed", feature="prepare_deepspeed at ZeRO-3", extra="deepspeed")
        engine, *_ = deepspeed.initialize(model=module, config=_resolve_auto(inference_ds_config(cfg), module))
        ref = as_adapter(engine)
    else:
        dtype = config_dtype(cfg) or next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        ref = as_adapter(module.to(device=device, dtype=dtype))
    return _for_inference(ref)


def prepare_fsdp(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """``model`` prepared for inference, sharded like the accelerator's FSDP policy.

    FSDP1: one unit per transformer block, with the plugin's sharding strategy, mixed
    precision and CPU offload. FSDP2: ``fully_shard`` per block and on the root, on the
    accelerator's mesh, with the plugin's mixed precision and offload policy, resharded after
    every forward (a reference never runs backward, so nothing needs to stay gathered). In eval
    mode, ``requires_grad`` left as it is. A model already wrapped in FSDP is returned as is,
    in eval mode. Call on every rank.
    """
    check_model(model, "prepare_fsdp")
    plugin = plugin_of(accelerator, "fsdp_plugin", "FSDP")
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    backend = "fsdp2" if version == 2 else "fsdp"
    module = bare_module(as_adapter(model), backend)
    if isinstance(module, Adapter):
        return _for_inference(module)
    device = torch.device(accelerator.device)
    ref: Adapter
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        module.to(device)
        kwargs: dict[str, Any] = {"mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
        if plugin.cpu_offload is not None and not isinstance(plugin.cpu_offload, bool):
            kwargs["offload_policy"] = plugin.cpu_offload
        ref = as_adapter(shard_fsdp2(module, _fsdp_mesh(accelerator, device), **kwargs))
    else:
        ref = as_adapter(wrap_fsdp1(
            module,
            device=device,
            sharding_strategy=plugin.sharding_strategy or plugin.reshard_after_forward,
            mixed_precision=plugin.mixed_precision_policy,
            cpu_offload=plugin.cpu_offload if not isinstance(plugin.cpu_offload, bool) else None,
            # TRL's fused LM head reads the head's weight from the model's own forward, outside
            # the head's forward, so the head must be gathered with the root unit.
            embedding_units=False,
        ))
    return _for_inference(ref)


@contextlib.contextmanager
def unwrap_model_for_generation(
    model: torch.nn.Module,
    accelerator: Any,
    gather_deepspeed3_params: bool = True,
    generation_kwargs: dict[str, Any] | None = None,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
) -> Iterator[torch.nn.Module]:
    """Yield the bare model of ``model`` (any wrapper) ready for ``generate()``. Collective.

    Full parameters are gathered on every sharded backend (ZeRO-3, FSDP1, FSDP2) and the
    model runs outside the sharding hooks, at unsharded speed; ``gather_deepspeed3_params=False``
    keeps a ZeRO-3 model sharded (slower, less memory). Inside: eval mode, no autograd, gradient
    checkpointing off. ``generation_kwargs`` override the model's ``generation_config`` for the
    duration. On exit every submodule's training flag, the checkpointing setting and the
    generation config are restored exactly, so ``gradient_checkpointing_kwargs`` is accepted for
    TRL compatibility but not needed. A ``model`` from inside a wrapper that ``accelerator`` prepared is read
    through that wrapper.
    """
    wm = prepared_policy(model, accelerator)
    if gather_deepspeed3_params or not (wm.backend == "deepspeed" and wm.zero_stage == 3):
        with wm.generation() as inner, _generation_config(inner, generation_kwargs):
            yield inner
    else:
        # What generation() does to modes, without gathering: ZeRO-3's hooks stay in the call path.
        inner = wm.unwrap()
        with generation_modes(wm.module), _generation_config(inner, generation_kwargs):
            yield inner


@contextlib.contextmanager
def _generation_config(model: torch.nn.Module, overrides: Mapping[str, Any] | None) -> Iterator[None]:
    get_base = getattr(model, "get_base_model", None)
    target = get_base() if callable(get_base) else model  # PEFT: the config lives on the base model
    original = getattr(target, "generation_config", None)
    if not overrides or original is None:
        yield
        return
    updated = copy.deepcopy(original)
    updated.update(**overrides)
    target.generation_config = updated
    try:
        yield
    finally:
        target.generation_config = original


# What patch_trl replaced: ``swaps`` (module, name, original); ``undo()`` (or leaving the ``with``
# block) puts TRL's functions back, also in trl modules imported since the patch.
TRLPatch = Patch


def patch_trl(*, vllm_server: bool = False, sync_timeout: float = 120.0) -> TRLPatch:
    """Make TRL's trainers call this module's drop-ins instead of TRL's own.

    Replaces the three functions in ``trl.models.utils`` and in every loaded ``trl`` module
    that holds them (matched by identity, so nothing else is touched); trainer modules
    imported later pick up the replacements from ``trl.models``. Also routes the weight sync of
    ``VLLMGeneration`` (GRPO, RLOO, distillation; server and colocate mode) through wrapkit's stream
    (``_trl_sync``): the Hub's layout on every backend, LoRA merged without touching the live weights; online DPO's
    own sync (``_trl_online_dpo``) and the async trainers' (``_trl_async``) alike.
    Call once in every process, before building the trainer. Returns a ``TRLPatch`` to undo it
    (``swaps``: the functions, ``methods``: the methods replaced); patching twice is a no-op.

    ``vllm_server=True``: TRL's server mode sends the weights through wrapkit's ``VLLMEngine`` instead of TRL's
    NCCL communicator (TRL's client still generates): every rank enters each sync, each step has a timeout of
    ``sync_timeout`` seconds, and the server's weight version is checked after it. A CPU trainer speaks gloo (the
    server started with ``--weight-transfer-config '{"backend": "gloo"}'``, wrapkit installed beside vLLM), a GPU
    trainer vLLM's NCCL. TRL's configuration is unchanged.
    """
    require("trl", feature="patch_trl", extra="trl")
    source = importlib.import_module("trl.models.utils")
    pairs = {id(original): (original, ours) for name, ours in DROP_INS.items()
             if (original := getattr(source, name, None)) is not None and original is not ours}
    methods = []
    with contextlib.suppress(ImportError):  # TRL releases before the vLLM helper class
        generation = importlib.import_module("trl.generation.vllm_generation").VLLMGeneration
        methods.append((generation, "_iter_named_params", iter_named_params))
        if "_iter_named_params" in generation.__dict__:  # TRL 1.x; 0.29's sync_weights pushes tensors itself
            methods += server_methods(generation, sync_timeout, vllm_server)
    methods += async_methods()
    methods += online_dpo_methods(sync_timeout, vllm_server)
    return swap("trl", pairs, then=swap_methods(methods))


DROP_INS: dict[str, Any] = {
    "prepare_deepspeed": prepare_deepspeed,
    "prepare_fsdp": prepare_fsdp,
    "unwrap_model_for_generation": unwrap_model_for_generation,
}


# -- helpers -----------------------------------------------------------------------------------
def _for_inference(wm: Adapter) -> torch.nn.Module:
    """Placed on its compute device (verified) and in eval mode, returned as the native module.

    Not frozen, unlike ``prepare_reference``: TRL also passes the policy itself through
    ``prepare_deepspeed`` (DPO/KTO precomputing reference log-probs), and that one must keep training.
    TRL runs these models under ``torch.no_grad()``, so nothing is lost."""
    place(wm)
    set_modes(wm.module, False)  # also reaches modules whose train() override skips children
    return wm.module


def check_model(model: Any, caller: str) -> None:
    if model is None:
        raise ReferenceModelError(
            f"{caller} got None instead of a model. With a PEFT policy there is no separate reference "
            "model: use wrapkit.prepare_reference(policy), which gives the policy with its adapters "
            "disabled; otherwise pass the reference model (e.g. loaded again from the policy's checkpoint)."
        )


def plugin_of(accelerator: Any, attr: str, what: str) -> Any:
    state = getattr(accelerator, "state", None)
    plugin = getattr(state, attr, None)
    if plugin is None:
        raise ReferenceModelError(
            f"the accelerator is not set up for {what} (accelerator.state.{attr} is None); use the helper for "
            "the accelerator's backend (prepare_deepspeed or prepare_fsdp), or wrapkit.prepare_reference(policy, "
            "ref_model), which shards a reference like any prepared policy."
        )
    return plugin


def _hidden_size(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    sizes = getattr(cfg, "hidden_sizes", None)
    if sizes:
        return int(max(sizes))
    size = getattr(cfg, "hidden_size", None)
    return int(size) if isinstance(size, int) else None


def _resolve_auto(cfg: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Fill the ``"auto"`` values an inference engine needs; drop the rest (DeepSpeed's defaults apply)."""
    hidden = _hidden_size(model)
    zero = cfg["zero_optimization"]
    for key, size in _HIDDEN_SIZED.items():
        if zero.get(key) == "auto":
            if hidden is None:
                del zero[key]
            else:
                zero[key] = size(hidden)

    def strip(node: dict[str, Any]) -> dict[str, Any]:
        return {k: strip(v) if isinstance(v, dict) else v for k, v in node.items() if v != "auto"}

    out = strip(cfg)
    if "train_batch_size" not in out and "train_micro_batch_size_per_gpu" not in out:
        out["train_micro_batch_size_per_gpu"] = 1  # never used for inference, but DeepSpeed requires one
        out.pop("gradient_accumulation_steps", None)
    return out


def _fsdp_mesh(accelerator: Any, device: torch.device) -> Any:
    mesh = getattr(accelerator, "torch_device_mesh", None)
    parallelism = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and parallelism is not None:
        return mesh[tuple(parallelism.fsdp_dim_names)]
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))
