"""accelerate's DDP, FSDP1, FSDP2 and DeepSpeed setups on CPU gloo ranks.

accelerate decides the distributed type from the devices it finds: on a machine without
accelerators it only offers DDP over gloo, and maps an FSDP plugin to "no distribution". The
FSDP code paths themselves (accelerate's ``prepare``, torch's FSDP, TRL's FSDP branches) run
on the CPU. So for FSDP the state is built normally and then told it is FSDP, which is the
one value the device check would have set; everything downstream is the real code. DeepSpeed
needs no such step, only the ``gloo`` backend named, so that accelerate counts the ranks
instead of assuming a single process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

KINDS = ("ddp", "fsdp", "fsdp2", "zero2", "zero3")


def ds_config(stage: int, hidden: int | None = None) -> dict[str, Any]:
    """``hidden``: the sizes accelerate reads off ``config.hidden_size`` given outright (a vision-language model's
    config has none at the top)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        # What transformers writes for a config built from TrainingArguments: sized from the model later.
        "zero_optimization": {"stage": stage, **({
            "reduce_bucket_size": hidden * hidden if hidden else "auto",
            "stage3_prefetch_bucket_size": hidden * hidden if hidden else "auto",
            "stage3_param_persistence_threshold": 10 * hidden if hidden else "auto",
        } if stage == 3 else {})},
    }


def fsdp_plugin(kind: str, layers: list[str] | None = None, **settings: Any) -> Any:
    """``layers``: the class names wrapped as units (default: a Llama's decoder layers); ``settings``: more of the
    plugin's (``use_orig_params=True``, as PEFT under FSDP1 needs)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2 if kind == "fsdp2" else 1,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=layers or ["LlamaDecoderLayer"],
        cpu_ram_efficient_loading=False,
        sync_module_states=False,  # needs an accelerator device to materialise on
        **settings,
    )


def accelerator(kind: str, mixed_precision: str = "no", layers: list[str] | None = None, **settings: Any) -> Any:
    """An ``Accelerator`` set up for ``kind`` on the CPU ranks of this process group."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if kind == "ddp":
        return Accelerator(cpu=True, mixed_precision=mixed_precision)  # DDP over gloo: accelerate's multi-CPU mode
    _partial_state(kind)
    if kind.startswith("zero"):
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(int(kind[-1]), **settings)),
                           mixed_precision=mixed_precision)
    plugin = fsdp_plugin(kind, layers, **settings)
    _declare_fsdp(plugin, mixed_precision)
    return Accelerator(fsdp_plugin=plugin, mixed_precision=mixed_precision)


def trainer_arguments(kind: str, layers: list[str] | None = None) -> dict[str, Any]:
    """Set up accelerate's state for a transformers/TRL trainer on ``kind``; returns the
    ``TrainingArguments`` keywords that select it. ``layers``: FSDP's unit classes (default: a Llama's)."""
    if kind == "ddp":
        return {"use_cpu": True}
    _partial_state(kind)
    common = {"accelerator_config": {"use_configured_state": True}, "ddp_backend": "gloo"}
    if kind.startswith("zero"):
        return {"deepspeed": ds_config(int(kind[-1])), **common}
    plugin = fsdp_plugin(kind, layers)
    _declare_fsdp(plugin)
    fsdp_config = {"fsdp_version": plugin.fsdp_version, "sync_module_states": False,
                   "transformer_layer_cls_to_wrap": layers or ["LlamaDecoderLayer"]}
    return {"fsdp": "full_shard", "fsdp_config": fsdp_config, **common}


def _partial_state(kind: str) -> None:
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    if kind.startswith("zero"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def _declare_fsdp(plugin: Any, mixed_precision: str = "no") -> None:
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    # Initialises the process-wide state, without FSDP on this machine.
    Accelerator(fsdp_plugin=plugin, mixed_precision=mixed_precision)
    # The device check left FSDP out (see the module docstring); set what it would have set.
    # Accelerators created from here on see an FSDP setup.
    for state in (PartialState(), AcceleratorState()):
        state.distributed_type = DistributedType.FSDP
    # accelerate before 1.13 names this device cpu:0, which FSDP1 then refuses beside its own cpu.
    if PartialState().device.type == "cpu":
        PartialState().device = torch.device("cpu")
    AcceleratorState().fsdp_plugin = plugin
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what the FSDP branch of accelerate's set-up does


@contextmanager
def clean_state() -> Iterator[None]:
    """Leave no accelerate, transformers-DeepSpeed or environment state behind (the ranks are shared)."""
    from accelerate.state import AcceleratorState

    saved_env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(saved_env)
