"""Scenarios for models prepared by accelerate, run on the shared two-rank group."""

from __future__ import annotations

import os
from typing import Any

import torch

import wrapkit
from wrapkit.cli._models import tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128


def prepared(kind: str) -> dict[str, Any]:
    """``adapt(accelerator.prepare(model))`` for accelerate's DDP (``ddp``) or DeepSpeed (``zero2``/``zero3``)
    setup, then a reference, a training step and a generation through wrapkit."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    saved_env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        if kind == "ddp":
            # On a machine without accelerators accelerate's multi-process mode is DDP over gloo.
            accelerator = Accelerator(cpu=True)
        else:
            plugin = DeepSpeedPlugin(hf_ds_config={
                "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": int(kind[-1])},
            })
            accelerator = Accelerator(deepspeed_plugin=plugin)
        model = tiny_llama()
        expected = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        wm = wrapkit.adapt(model)
        ref = wrapkit.prepare_reference(wm)
        with torch.no_grad():
            ref_diff = float((ref(TOKENS).logits - wm(TOKENS).logits).abs().max())
        loss = wm(TOKENS, labels=TOKENS).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with wm.generation() as m:
            out = m.generate(TOKENS[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
        return {
            "distributed_type": str(accelerator.distributed_type),
            "backend": wm.backend,
            "zero_stage": wm.zero_stage,
            "is_sharded": wm.is_sharded,
            "config": type(wm.config).__name__,
            "num_parameters": wm.num_parameters(),
            "expected": expected,
            "ref_backend": ref.backend,
            "ref_sharded": ref.is_sharded,
            "ref_diff": ref_diff,
            "generated": tuple(out.shape),
            "training_after": all(m.training for m in wm.unwrap().modules()),
        }
    finally:
        AcceleratorState._reset_state(True)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # accelerate registers its DeepSpeed config with transformers and in the environment;
        # later scenarios on the same ranks must not see it.
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(saved_env)
