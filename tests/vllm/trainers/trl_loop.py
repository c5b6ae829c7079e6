"""TRL's real ``GRPOTrainer`` for a few steps on two CPU ranks, generating with a real vLLM (vLLM's CPU build).

    torchrun --nproc_per_node 2 tests/vllm/trainers/trl_loop.py --backend fsdp2 --model DIR --url URL --json OUT

Server mode against ``vllm serve`` at ``URL`` (started on ``DIR`` with wrapkit's gloo backend), its weights sent by
wrapkit's ``VLLMEngine`` (``patch_trl(vllm_server=True)``); ``--colocate``: TRL's colocate mode, an engine in each
rank's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``--no-sync``: the weights are never sent (the check
must then fail). Rank 0 writes, per step, the largest difference between vLLM's log-probabilities of the sampled
tokens and the trainer's own (TRL's ``sampling/sampling_logp_difference/max``), and the syncs' versions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The decoder layer class FSDP wraps as a unit, per family (tests/vllm/server.py's tiny models).
LAYERS = {"llama": "LlamaDecoderLayer", "qwen2-tied": "Qwen2DecoderLayer", "qwen3-moe": "Qwen3MoeDecoderLayer"}


def _reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: the number of even-numbered words (about half of any sample, so rewards vary)."""
    return [float(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def parser(steps: int) -> argparse.ArgumentParser:
    """The arguments this script and ``trl_async.py`` share (``steps``: the default number of steps)."""
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--family", default="llama")
    p.add_argument("--model", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--group-port", type=int, required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--no-sync", action="store_true")
    return p


def lora_config() -> Any:
    """The adapters both scripts train (``LoraConfig``)."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])


def main() -> None:
    p = parser(steps=4)
    p.add_argument("--colocate", action="store_true")
    a = p.parse_args()

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu
    from wrapkit.integrations.trl import patch_trl

    patch_trl(vllm_server=True, sync_timeout=60.0)
    if a.colocate:
        # TRL builds its engine with no dtype, and vLLM turns a float32 checkpoint into 16-bit floats (log-prob
        # gaps of 3e-3 to 5e-3 here): the engine is told the trainer's dtype, as the check is of the sync.
        import functools

        import trl.generation.vllm_generation as generation

        generation.LLM = functools.partial(generation.LLM, dtype="float32", enforce_eager=True)
    versions: list[str] = []
    sync = VLLMGeneration.sync_weights

    def recorded(self: Any) -> None:
        if a.no_sync:
            return
        sync(self)
        versions.append(self.wrapkit_engine._dense.syncs if not a.colocate else len(versions) + 1)

    VLLMGeneration.sync_weights = recorded  # type: ignore[method-assign]
    args = GRPOConfig(
        output_dir=str(Path(a.json).parent / "out"), per_device_train_batch_size=2, max_steps=a.steps,
        # A large rate: each step moves the policy far enough that a server left behind shows it.
        learning_rate=0.05 if a.lora else 0.01, report_to="none", logging_steps=1, save_strategy="no",
        bf16=False, seed=0, num_generations=2, max_completion_length=8, beta=0.0,
        use_vllm=True, vllm_server_timeout=60, vllm_group_port=a.group_port,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1, "vllm_max_model_length": 128}
           if a.colocate else {"vllm_mode": "server", "vllm_server_base_url": a.url}),
        **accelerate_cpu.trainer_arguments(a.backend, [LAYERS[a.family]]),
    )
    peft_config = lora_config() if a.lora else None
    # The word-level tokenizer the model was saved with (AutoTokenizer forces Qwen2's own on a Qwen2 config).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(a.model)
    rows = [{"prompt": f"w{i % 8} w{(i + 1) % 8} w{(i + 2) % 8}"} for i in range(32)]
    trainer = GRPOTrainer(model=a.model, reward_funcs=_reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    engine = getattr(trainer.vllm_generation, "wrapkit_engine", None)
    obs = {"diff": [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history
                    if "sampling/sampling_logp_difference/max" in h],
           "syncs": versions, "backend": type(trainer.model_wrapped).__name__}
    if engine is not None:
        engine.close()
    report_and_close(obs, a.json)


if __name__ == "__main__":
    main()
