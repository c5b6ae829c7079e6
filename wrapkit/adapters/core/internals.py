"""The private fields of other libraries that wrapkit touches: all of them listed here, by the object
that carries them (``PRIVATE_FIELDS``), and those of FSDP1, FSDP2/DTensor and ZeRO-3 checked in one
place when a model is adapted.

These backends have no public API for what wrapkit needs (per-parameter shard ranges, the
partition of a ZeRO-3 parameter, FSDP2's input and output casts). Their private fields are
stable across the versions wrapkit is tested with; a version that renamed one would otherwise
fail deep inside an operation with an ``AttributeError``. Checking on ``adapt()`` turns that
into an ``UnsupportedModelError`` that names the version and what to install.
``tests/project/test_private_reads.py`` fails on a private field read anywhere in the package and not
listed here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..._errors import UnsupportedModelError
from ..._imports import version_of

__all__ = ["require_internals", "FSDP1_UNIT", "FSDP1_HANDLE", "FSDP1_FLAT", "FSDP2_STATE", "FSDP2_GROUPS", "DTENSOR",
           "ZERO3_PARAM", "FSDP2_MODULE", "FSDP_MANAGED", "DEVICE_MESH", "PRIVATE_FIELDS"]

# What each backend's objects must have, by the object that carries it: checked on adapt().
FSDP1_UNIT = ("_handle", "_fsdp_wrapped_module")
FSDP1_HANDLE = ("flat_param", "uses_sharded_strategy", "_training_state", "_use_orig_params", "_use_sharded_views",
                "_use_sharded_grad_views", "_fwd_bwd_param_dtype", "_prefetched")
FSDP1_FLAT = ("_fqns", "_params", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask",
              "_param_infos", "_shared_param_infos", "_shard_param_infos", "_unpadded_unsharded_size")
FSDP2_MODULE = ("_get_fsdp_state",)
# The flag FSDP1 and FSDP2 leave on the modules they manage; transformers' generate() syncs every rank at
# every step (synced_gpus) where it sees it, an all-reduce per token that a bypassed, full module does not need.
FSDP_MANAGED = ("_is_fsdp_managed_module",)
FSDP2_STATE = ("_mp_policy", "_device")
# A state's parameter groups: a list in newer torch, one group (or None) in torch 2.11; one of them must be there.
FSDP2_GROUPS = ("_fsdp_param_groups", "_fsdp_param_group")
DTENSOR = ("_local_tensor",)
# A group across several mesh dimensions (FSDP2 beside tensor parallelism: shard x tp) has no public API.
DEVICE_MESH = ("_flatten",)
ZERO3_PARAM = ("ds_tensor", "ds_shape", "ds_numel", "ds_status")

# Every private field of another library that wrapkit reads or writes, by the object that carries it.
# tests/project/test_architecture.py finds each one in the package and fails on a name missing here.
PRIVATE_FIELDS: dict[str, tuple[str, ...]] = {
    # Checked on adapt() (above).
    "FSDP1 unit": FSDP1_UNIT,
    "FSDP1 flat-parameter handle": FSDP1_HANDLE,
    "FSDP1 flat parameter": FSDP1_FLAT,
    "FSDP2 module": FSDP2_MODULE,
    "FSDP2 state": FSDP2_STATE,
    "FSDP2 state (one of)": FSDP2_GROUPS,
    # Newer torch's own casts of a state's inputs and output; torch 2.11 casts inline (wrapkit then casts alike).
    "FSDP2 state (optional)": ("_cast_forward_inputs", "_cast_output_dtype"),
    "DTensor": DTENSOR,
    "DeviceMesh (several dimensions split one copy)": DEVICE_MESH,
    # Read where present, with a fallback that is right where they are absent: set only under some
    # configurations (sharded strategies, HYBRID_SHARD, a device mesh, bf16 optimizers).
    "FSDP1 root (optional)": ("_inter_node_pg", "_use_full_prec_in_eval", "_device_mesh"),
    # The mesh a flattened one was cut from, for its context-parallel dimension.
    "DeviceMesh (optional)": ("_get_root_mesh",),
    "FSDP1 flat parameter (sharded strategies)": ("_local_shard", "_full_param_padded"),
    # The views a forward saved for its backward, re-pointed after a move under NO_SHARD.
    "FSDP1 flat parameter (optional)": ("_tensors",),
    "FSDP1 flat-parameter handle (NO_SHARD)": ("_get_unflat_views",),
    "DeepSpeed parameter under a bf16 optimizer": ("_hp_mapping",),
    # Read on objects that do not exist when a model is adapted, or outside the backends.
    "DeepSpeed engine config": ("_config", "_param_dict"),
    # Whether the engine class hangs its forward hooks on the module (0.19 does, 0.16 not): they name the engine.
    "DeepSpeed engine class (optional)": ("_create_module_forward_pre_hook",),
    "DeepSpeed GatheredParameters": ("_param_versions",),
    "DeepSpeed ZeRO-3 optimizer": ("_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",),
    # How DeepSpeed itself links each parameter to its fragment of new optimizer state (after a load).
    "DeepSpeed ZeRO-1/2 and bf16 optimizer": ("_lazy_init_hp_params_optimizer_state",),
    "FSDP1 ShardingStrategy": ("_HYBRID_SHARD_ZERO2",),
    # The mark FSDP1 leaves on each parameter it flattened: a module handed over from inside it is refused by it.
    "FSDP1 flattened parameter": ("_fsdp_flattened",),
    # torch's own module internals and namespaces, stable across every torch release wrapkit supports.
    "torch.nn.Module": ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                        "_non_persistent_buffers_set", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_version"),
    # Set by torch on a state-dict post-hook registered through the public API (its result must be None).
    "torch state-dict hook": ("_from_public_api",),
    # _make_wrapper_subclass: how a tensor subclass that only carries other tensors is made (torch's docs).
    "torch": ("_C", "_nn", "_foreach_add_", "_foreach_mul_", "_make_wrapper_subclass"),
    "torch.compile OptimizedModule": ("_orig_mod",),
    # Set by FSDP1 and FSDP2 on the modules they manage; cleared while a module runs bypassed (Bypass).
    "FSDP-managed module flag": FSDP_MANAGED,
    # _weight_conversions: what from_pretrained converted the checkpoint with (the Hub's layout, formats/hub.py).
    "transformers PreTrainedModel": ("_init_weights", "_no_split_modules", "_weight_conversions"),
    # Where transformers distributed the model itself (tp_plan, distributed_config): the meshes it made.
    # _tp_size: hidden from PEFT while it selects an adapter's tensors (saved_key_map), where it would gather them.
    "transformers distributed model": ("_mesh_manager", "_tp_size"),
    # Set on the experts modules transformers split over expert-parallel ranks (read beside FSDP2, core/foreign.py).
    "transformers expert-parallel experts": ("_is_expert_parallel",),
    # The models prepare() wrapped, read where present: TRL's vLLM helper holds a model from before prepare() (FSDP1's
    # root wrapper has parameters it does not reach); without the list the model is adapted as it is.
    "accelerate Accelerator": ("_models",),
    # The stage DistributedConfig(pp_size=...) records on the model, and its flag for the forward it installed.
    "transformers pipeline-parallel model": ("_pp_stage", "_pp_forward_wrapped"),
    "ms-swift lazy module": ("_class_to_module",),
    "Python's atexit": ("_run_exitfuncs",),
    # The worker group (the doctor's and the tests' processes) destroys the groups each scenario made; an engine's
    # weight-update group is registered with its ranks there (base/process_groups.py), as the engines do.
    "torch.distributed's group registry": ("_world",),
    # The only constructor of a group outside the default group's ranks (an engine's weight-update group).
    "torch.distributed's group constructor": ("_new_process_group_helper",),
    "DTensor's memoised sharding propagation": ("_clear_sharding_prop_cache",),
    # vLLM's layerwise reload, ended by the gloo plugin after a failed update (engines/vllm_gloo.py): no public way
    # gives a layer its previous tensors back.
    "vLLM's layerwise reload": ("_place_kernel_tensors", "_original_do_torchao_reload", "_do_torchao_reload"),
}

# The oldest releases the test-suite runs against (.ci/oldest.txt), for the error message.
_TESTED = {"torch": "2.13", "deepspeed": "0.16"}


def require_internals(objects: Iterable[Any], names: Sequence[str], what: str, package: str) -> None:
    """``UnsupportedModelError`` unless every one of ``objects`` has every attribute in ``names``."""
    for obj in objects:
        missing = [n for n in names if not hasattr(obj, n)]
        if missing:
            version = version_of(package) or "(unknown version)"
            raise UnsupportedModelError(
                f"this {package} {version} has no {', '.join(missing)} on its {what} ({type(obj).__name__}), "
                f"which wrapkit reads for lack of a public API; install a {package} release wrapkit supports "
                f"(tested from {_TESTED.get(package, 'the oldest declared release')} to the newest), or upgrade "
                "wrapkit."
            )
