"""Drop-ins for ms-swift's model helpers, built on wrapkit.

Same names, signatures and meaning as ms-swift's own (4.x):

* ``unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True,
  gather_parameters=None)`` (``swift.utils``): ms-swift's gathers ZeRO-3 only, and leaves every
  mode as the generation left it; ms-swift's ``TransformersEngine`` calls ``model.eval()``
  inside it, and nothing sets the modes back (failure #4, ms-swift issue 3107). This one gathers
  ZeRO-3, FSDP1 and FSDP2, runs outside the sharding hooks, and restores every submodule's
  training flag, gradient checkpointing and the generation config on exit.
* ``prepare_deepspeed(model, accelerator, deepspeed_config=None, deepspeed_plugin=None,
  training_args=None)`` (``swift.rlhf_trainers.utils``, for teacher and reward models) and
  ``prepare_fsdp(model, accelerator, evaluation_mode=True)``: a ``None`` model is refused with a
  ``ReferenceModelError``; ZeRO-3 gives an inference engine, ZeRO-0/1/2 the bare module on the
  device (ms-swift wraps it in a stage-0 engine for nothing); FSDP references are sharded per
  transformer block and resharded after every forward.

ms-swift also calls TRL's ``prepare_deepspeed`` / ``prepare_fsdp`` for reference models;
``patch_swift()`` replaces those with ``wrapkit.integrations.trl``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

from .._adapt import public
from .._errors import ReferenceModelError
from .._imports import require
from .._registry import as_adapter
from ..exchange.peft import adapter_tensors
from ..references.view import AdaptersOff
from . import trl as _trl
from ._patch import Patch, swap, swap_methods
from ._trl_server import colocated_cpu, colocated_loaded
from ._trl_sync import prepared_module, prepared_policy

__all__ = ["unwrap_model_for_generation", "prepare_deepspeed", "prepare_fsdp", "patch_swift", "SwiftPatch",
           "move_full_model_to_vllm", "move_adapter_to_vllm", "prepare_vllm_engine"]


@contextlib.contextmanager
def unwrap_model_for_generation(
    model: torch.nn.Module,
    accelerator: Any,
    gather_deepspeed3_params: bool = True,
    gather_parameters: list[Any] | None = None,
) -> Iterator[torch.nn.Module]:
    """Yield the bare model of ``model`` (any wrapper), full parameters in place, for generation.
    Collective.

    The yielded module is the very object ms-swift's inference engine holds, so generating
    through either runs on the gathered weights without the sharding hooks. ``gather_parameters``
    (a subset of names to gather) is accepted; every parameter is gathered, a superset.
    ``gather_deepspeed3_params=False`` keeps a ZeRO-3 model sharded. Every submodule's mode is
    restored on exit, whatever the generation code set.
    """
    with _trl.unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params) as inner:
        yield inner


def prepare_deepspeed(model: torch.nn.Module, accelerator: Any, deepspeed_config: dict[str, Any] | None = None,
                      deepspeed_plugin: Any = None, training_args: Any = None) -> torch.nn.Module:
    """``model`` prepared for inference next to a DeepSpeed policy, in eval mode. Call on every rank.

    The configuration comes from ``deepspeed_config`` (its ``"auto"`` values resolved from
    ``training_args`` as transformers does), else ``deepspeed_plugin``, else the accelerator's
    plugin. ZeRO-3: a DeepSpeed inference engine (training-only sections removed); ZeRO-0/1/2:
    the module on the accelerator's device in the config's compute dtype.
    """
    _trl.check_model(model, "prepare_deepspeed")
    config: Mapping[str, Any]
    if deepspeed_config is not None:
        if not isinstance(deepspeed_config, dict):
            raise ReferenceModelError(
                f"deepspeed_config must be a dict, got {type(deepspeed_config).__name__}; pass the parsed "
                "DeepSpeed configuration, or deepspeed_plugin=."
            )
        hf_deepspeed = require("transformers.integrations.deepspeed", feature="prepare_deepspeed(deepspeed_config=)",
                               extra="transformers")
        hf_config = hf_deepspeed.HfTrainerDeepSpeedConfig(dict(deepspeed_config))
        if training_args is not None:
            hf_config.trainer_config_process(training_args)
        config = hf_config.config
    elif deepspeed_plugin is not None:
        config = deepspeed_plugin.deepspeed_config
    else:
        config = _trl.plugin_of(accelerator, "deepspeed_plugin", "DeepSpeed").deepspeed_config
    return _trl.deepspeed_for_inference(model, config, accelerator.device)


def prepare_fsdp(model: torch.nn.Module, accelerator: Any, evaluation_mode: bool = True) -> torch.nn.Module:
    """``model`` sharded like the accelerator's FSDP1/FSDP2 policy, per transformer block, in eval
    mode. ``evaluation_mode`` (ms-swift's default) also freezes every parameter first."""
    _trl.check_model(model, "prepare_fsdp")
    if evaluation_mode:
        for p in model.parameters():
            p.requires_grad_(False)
    return _trl.prepare_fsdp(model, accelerator)


# -- GRPO's weight sync to vLLM ----------------------------------------------------------------
# ms-swift's GRPO (``RolloutTrainerMixin`` in ``swift.rlhf_trainers.rollout_mixin``) walks the wrappers itself on
# every sync: ZeRO-3 gathers per parameter group, FSDP2 ``full_tensor``, PEFT's in-place merge and unmerge (whose
# round trip moves frozen base weights by rounding), names mapped by hand. These two methods take the tensors from
# wrapkit instead; ms-swift's own sending (its client's flattened buckets or named params, the colocated engine's
# ``load_weights`` / ``add_lora``) and its engine-side steps stay as they are.
_MIXIN = "swift.rlhf_trainers.rollout_mixin"
_ORIGINAL_FULL: dict[str, Any] = {}
_ORIGINAL_ENGINE: dict[str, Any] = {}


def move_full_model_to_vllm(self: Any) -> None:
    """``RolloutTrainerMixin._move_full_model_to_vllm`` on wrapkit: the policy's full weights in the Hub's layout
    (experts per expert, each tied weight once), LoRA folded layer by layer without touching the live weights (or,
    where the rollout serves LoRA itself, the base weights and then the adapter), fed bucket by bucket to
    ms-swift's ``_load_state_dict_to_vllm``. Collective: call on every rank, as ms-swift does."""
    mixin = importlib.import_module(_MIXIN)
    colocate, server = self.vllm_mode == "colocate", self.vllm_mode == "server"
    if colocate and mixin.is_torch_npu_available():
        return _ORIGINAL_FULL["method"](self)  # type: ignore[no-any-return]  # vLLM-Ascend reloads its own way
    policy = prepared_policy(self.model, self.accelerator)
    peft = "peft" in policy.stack
    served_lora = peft and bool(self.rollout_enable_lora)
    # With LoRA served by the rollout, the base weights go out unmerged: the policy with its adapters off.
    source = public(AdaptersOff(as_adapter(policy.module))) if served_lora else policy
    if colocate:
        mixin.patch_vllm_moe_model_weight_loader(self.engine.inner_model)
    mib = int(os.environ.get("SWIFT_UPDATE_WEIGHTS_BUCKET_SIZE", 512))
    for bucket in source.stream_full_parameters(bucket_bytes=mib * 2**20, merge_adapters=peft and not served_lora,
                                                dst_rank=0 if server else None):
        self._load_state_dict_to_vllm(dict(bucket.named_tensors()))
    if colocate:
        mixin.finish_vllm_weight_reload(self.engine.inner_model, model_config=self.engine.engine.model_config,
                                        target_device=self.accelerator.device)
        colocated_loaded(self.engine.inner_model)  # ms-swift's post-load step leaves the CPU build's experts unpacked
    elif server and self.accelerator.is_main_process:
        self.vllm_client.process_weights_after_loading()
    if peft:
        self.base_sync_done = True
        if served_lora:
            self._move_adapter_to_vllm()


def prepare_vllm_engine(self: Any) -> Any:
    """``RolloutTrainerMixin._prepare_vllm_engine`` (colocate mode's in-process engine), built after
    ``colocated_cpu()``: on vLLM's CPU build its linear layers then keep weights that the syncs' ``load_weights``
    can load into (the packed copy the build keeps otherwise has no loader)."""
    colocated_cpu()
    return _ORIGINAL_ENGINE["method"](self)


def move_adapter_to_vllm(self: Any) -> None:
    """``RolloutTrainerMixin._move_adapter_to_vllm`` on wrapkit: the ``default`` adapter's tensors as PEFT's
    ``get_peft_model_state_dict`` names them, gathered by wrapkit (no merge, nothing written to the model), sent
    as ms-swift sends them. Collective: call on every rank."""
    mixin = importlib.import_module(_MIXIN)
    server = self.vllm_mode == "server"
    receives = not server or self.accelerator.is_main_process  # the others only take part in the gathers
    gathered = adapter_tensors(as_adapter(prepared_module(self.model, self.accelerator)), "default", keep=receives)
    if not receives:
        return
    device = self.accelerator.device
    tensors = {k: v.to(device) for k, v in gathered.items()}
    config = self.model.peft_config.get("default")
    if server:
        if getattr(self.args, "enable_flattened_weight_sync", True):
            bucket = mixin.FlattenedTensorBucket(named_tensors=list(tensors.items()))
            self.vllm_client.update_adapter_flattened_param(config, bucket.get_metadata(),
                                                            bucket.get_flattened_tensor())
        else:
            self.vllm_client.update_adapter_param(config, tensors)
    elif self.vllm_mode == "colocate":
        request: dict[str, Any] = {"lora_name": mixin.VLLM_LORA_NAME, "lora_int_id": mixin.VLLM_LORA_INT_ID,
                                   "lora_path": mixin.VLLM_LORA_PATH, "peft_config": dataclasses.asdict(config),
                                   "lora_tensors": tensors}
        if mixin.vllm_supports_lora_load_inplace():
            request["load_inplace"] = True
        self.engine.engine.add_lora(mixin.TensorLoRARequest(**request))


# -- patching ----------------------------------------------------------------------------------
# Where ms-swift defines the helpers it has its own copies of.
_SOURCES = {
    "unwrap_model_for_generation": ("swift.utils.transformers_utils", unwrap_model_for_generation),
    "prepare_deepspeed": ("swift.rlhf_trainers.utils", prepare_deepspeed),
    "prepare_fsdp": ("swift.rlhf_trainers.utils", prepare_fsdp),
}


# What patch_swift replaced: ``swaps`` (module, name, original); ``undo()`` (or leaving the ``with``
# block) puts ms-swift's and TRL's functions back, also where the drop-ins were picked up since.
SwiftPatch = Patch


def patch_swift() -> SwiftPatch:
    """Make ms-swift's trainers use this module's drop-ins (and TRL's helpers ``wrapkit.integrations.trl``'s).

    ms-swift's own ``unwrap_model_for_generation``, ``prepare_deepspeed`` and ``prepare_fsdp`` are
    replaced where they are defined and in every loaded ``swift`` module that holds them (matched
    by identity, lazily re-exporting modules such as ``swift.utils`` included); TRL's
    ``prepare_deepspeed``, ``prepare_fsdp`` and ``unwrap_model_for_generation`` are replaced in TRL
    (``patch_trl``) and in every ``swift`` module that imported them. Modules imported later pick
    the drop-ins up from where they import them. Call once per process, before building the
    trainer; patching twice is a no-op. Returns a ``SwiftPatch`` to undo it.
    """
    require("swift", feature="patch_swift", extra="swift")
    trl_patch = _trl.patch_trl()
    pairs = dict(trl_patch.pairs)
    for name, (module_name, ours) in _SOURCES.items():
        original = getattr(importlib.import_module(module_name), name)
        if original is not ours:
            pairs[id(original)] = (original, ours)
    methods = []
    with contextlib.suppress(ImportError, AttributeError):  # ms-swift releases before the GRPO rollout mixin
        mixin = importlib.import_module(_MIXIN).RolloutTrainerMixin
        if mixin.__dict__.get("_move_full_model_to_vllm") is not move_full_model_to_vllm:
            _ORIGINAL_FULL["method"] = mixin.__dict__["_move_full_model_to_vllm"]
        if mixin.__dict__.get("_prepare_vllm_engine") is not prepare_vllm_engine:
            _ORIGINAL_ENGINE["method"] = mixin.__dict__["_prepare_vllm_engine"]
        methods = [(mixin, "_move_full_model_to_vllm", move_full_model_to_vllm),
                   (mixin, "_move_adapter_to_vllm", move_adapter_to_vllm),
                   (mixin, "_prepare_vllm_engine", prepare_vllm_engine)]
    return swap("swift", pairs, _bindings, then=swap_methods(methods, then=trl_patch))


def _bindings(module: ModuleType) -> list[tuple[str, Any]]:
    """The module's global names, and for a lazily importing module (``swift.utils``) also the
    names it re-exports from submodules already imported."""
    out = list(vars(module).items())
    lazy: Mapping[str, str] = getattr(module, "_class_to_module", None) or {}
    for name in _SOURCES:
        if name in lazy and name not in vars(module) and f"{module.__name__}.{lazy[name]}" in sys.modules:
            out.append((name, getattr(module, name)))
    return out
