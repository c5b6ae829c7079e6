"""ms-swift's own GRPO pipeline (``swift.pipelines.rlhf_main``) for a few steps on two CPU ranks in colocate mode:
an engine of vLLM's CPU build in each rank's process, loaded by ms-swift's own sync (on wrapkit's stream under
``patch_swift()``). Runs in ms-swift's environment with vLLM's CPU build beside it (``.ci/swift``).

    torchrun --nproc_per_node 2 tests/vllm/trainers/swift_grpo.py --backend zero3 --model DIR --data FILE --json OUT

``DIR`` and ``FILE`` as ``tests/integrations/swift_run.py`` writes them (``save_tiny(heads=2)``). Rank 0 writes, per
step, the largest difference between vLLM's log-probabilities of the sampled tokens and the trainer's own of the
same tokens (the two tensors ms-swift's off-policy metrics compare), over both ranks. ``--no-sync``: the weights
are never sent, which must fail that check once the policy has moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["ddp", "zero3", "fsdp2"], required=True)
    p.add_argument("--model-type", default="llama")  # ms-swift's name of the family
    p.add_argument("--layer", default="LlamaDecoderLayer")  # the class FSDP wraps as a unit
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--no-patch", dest="patch", action="store_false")
    a = p.parse_args()
    out = Path(a.json).parent

    import torch
    import torch.distributed as dist

    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu
    from tests.integrations.swift_run import _fsdp2_config, _toy_reward

    accelerate_cpu.trainer_arguments(a.backend, [a.layer])
    if a.patch:
        from wrapkit.integrations.swift import patch_swift

        patch_swift()
    _toy_reward()
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
    from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin

    diffs: list[float] = []
    syncs: list[int] = []
    metrics = GRPOTrainer._compute_rollout_offpolicy_metrics

    def recorded(self: Any, mine: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> Any:
        # The largest difference over the sampled tokens, on either rank (each rank's engine sampled its own).
        local = ((mine - theirs).abs() * mask).max().reshape(1).double()
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        diffs.append(float(local))
        return metrics(self, mine, theirs, mask)

    GRPOTrainer._compute_rollout_offpolicy_metrics = recorded  # type: ignore[method-assign]
    move = RolloutTrainerMixin._move_model_to_vllm

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        if not a.no_sync:
            move(self, *args, **kwargs)
            syncs.append(self.state.global_step)

    RolloutTrainerMixin._move_model_to_vllm = counted  # type: ignore[method-assign]
    from swift.pipelines import rlhf_main

    argv = [
        "--rlhf_type", "grpo", "--model", a.model, "--model_type", a.model_type, "--template", "default",
        "--dataset", a.data, "--tuner_type", "lora" if a.lora else "full", "--torch_dtype", "float32",
        "--max_steps", str(a.steps), "--per_device_train_batch_size", "2", "--max_length", "64",
        "--save_strategy", "no", "--split_dataset_ratio", "0", "--dataset_num_proc", "1", "--report_to", "none",
        "--logging_steps", "1", "--learning_rate", "0.05" if a.lora else "0.01", "--fp16", "false",
        "--bf16", "false", "--output_dir", str(out / "out"), "--ddp_backend", "gloo", "--seed", "0",
        "--warmup_ratio", "0", "--num_generations", "2", "--max_completion_length", "8",
        "--reward_funcs", "toy_vowels", "--beta", "0.0",
        "--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.1",
        "--vllm_max_model_len", "128", "--vllm_enforce_eager", "true", "--log_rollout_offpolicy_metrics", "true",
    ]
    if a.lora:
        # No dropout on the adapters' path (ms-swift's default is 0.05): the trainer's log-probabilities would be
        # of a randomly thinned model, which no engine serves.
        argv += ["--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--target_modules", "q_proj",
                 "v_proj", "down_proj"]
    # DDP: accelerate's own CPU set-up; the others on the state set up above (tests/integrations/accelerate_cpu.py).
    argv += ["--use_cpu", "true"] if a.backend == "ddp" else [
        "--accelerator_config", json.dumps({"use_configured_state": True})]
    if a.backend == "zero3":
        argv += ["--deepspeed", "zero3"]
    elif a.backend == "fsdp2":
        argv += ["--fsdp", _fsdp2_config(out / "fsdp2.json")]
    error = None
    try:
        rlhf_main(argv)
    except Exception as exc:  # the unpatched run may fail: reported, not raised
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    report_and_close({"diff": diffs, "syncs": syncs, "error": error}, a.json)


if __name__ == "__main__":
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
                       # ms-swift's own vLLM plugin (an embedding model) imports vLLM's Qwen3-VL, which needs a
                       # torchvision; none is built for the CPU torch here, and a Llama needs neither.
                       "VLLM_PLUGINS": "wrapkit_gloo"}.items():
        os.environ.setdefault(key, value)
    main()
