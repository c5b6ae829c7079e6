"""A real TRL trainer for a few steps on two CPU ranks, with wrapkit's drop-ins patched in.

    torchrun --nproc_per_node 2 tests/integrations/trl_run.py --trainer dpo --backend zero3 --model DIR --json OUT

``DIR`` holds a tiny Llama and a word-level tokenizer saved by ``save_tiny`` (nothing is
downloaded). Rank 0 writes what both ranks observed to ``OUT``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
LAYERS = 2


def save_tiny(path: str | Path) -> None:
    """A 2-layer Llama and a tokenizer for its 64 words, saved with ``save_pretrained``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def _reward(completions: list[str], **_: Any) -> list[float]:
    """Toy GRPO reward: the number of even-numbered words (about half of any sample, so rewards vary)."""
    return [float(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def _recording(cls: type) -> type:
    """``cls`` noting, at every loss computation, whether the whole policy is in training mode
    (GRPO generates right before: a policy left in eval mode would show here)."""
    import wrapkit

    class Recording(cls):  # type: ignore[misc, valid-type]
        train_modes: list[bool] = []

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.train_modes.append(all(m.training for m in wrapkit.adapt(model).unwrap().modules()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def _shared_dataset(rows: list[dict[str, Any]], path: Path) -> Any:
    """The rows as a dataset stored on disk, so the cache files TRL writes on rank 0 (precomputed
    log-probs) are found by every rank; an in-memory dataset caches in a per-process temp dir."""
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk

    if dist.get_rank() == 0:
        Dataset.from_list(rows).save_to_disk(str(path))
    dist.barrier()
    return load_from_disk(str(path))


def _numel(module: Any) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["dpo", "dpo-precompute", "grpo"], required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import wrapkit
    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu
    from wrapkit.integrations.trl import patch_trl

    # Once per process, before the trainer exists: TRL's helpers become wrapkit's.
    patched = patch_trl()
    common: dict[str, Any] = dict(
        output_dir=str(Path(a.json).parent / "out"), per_device_train_batch_size=2, max_steps=a.steps,
        learning_rate=1e-3, report_to="none", logging_steps=1, save_strategy="no", bf16=False, seed=0,
        **accelerate_cpu.trainer_arguments(a.backend),
    )
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if a.trainer.startswith("dpo"):
        from trl import DPOConfig, DPOTrainer

        rows = [{"prompt": f"w{i % 8} w{(i + 1) % 8}", "chosen": f" w{3 + i % 5} w4", "rejected": f" w{40 + i % 5} w50"}
                for i in range(16)]
        # precompute: no reference model; DPOTrainer runs the policy itself through
        # prepare_deepspeed once for the reference log-probs, then trains it.
        precompute = a.trainer == "dpo-precompute"
        args = DPOConfig(max_length=16, precompute_ref_log_probs=precompute, **common)
        # Models are loaded after the arguments, as in a training script: under ZeRO-3 they come
        # out of from_pretrained already partitioned.
        policy = AutoModelForCausalLM.from_pretrained(a.model)
        ref_model = None if precompute else AutoModelForCausalLM.from_pretrained(a.model)
        trainer: Any = _recording(DPOTrainer)(
            model=policy, ref_model=ref_model, args=args,
            train_dataset=_shared_dataset(rows, Path(a.json).parent / "data"), processing_class=tokenizer,
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        rows = [{"prompt": f"w{i % 8} w{(i + 1) % 8} w{(i + 2) % 8}"} for i in range(16)]
        args = GRPOConfig(num_generations=2, max_completion_length=4, beta=0.1, **common)
        trainer = _recording(GRPOTrainer)(model=a.model, reward_funcs=_reward, args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    from wrapkit.integrations import trl as dropins

    trainer_module = sys.modules[type(trainer).__mro__[1].__module__]  # TRL's class, under the recorder
    obs: dict[str, Any] = {
        "patched": [f"{m.__name__}.{n}" for m, n, _ in patched.swaps],
        # The trainer module was imported after patch_trl(), and still sees the drop-ins.
        "trainer_sees": sorted(n for n in ("prepare_deepspeed", "prepare_fsdp", "unwrap_model_for_generation")
                               if getattr(trainer_module, n, None) is getattr(dropins, n)),
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        # Share of the parameters outside the decoder layers (embeddings, head, final norm).
        "outside_blocks": 1 - _numel(trainer.model.model.layers) / _numel(trainer.model),
        "ln2": math.log(2),
    }
    ref = trainer.ref_model
    rw = wrapkit.adapt(ref) if ref is not None else None
    if rw is not None:
        obs.update({
            "ref_type": type(ref).__name__,
            "ref_backend": rw.backend,
            "ref_blocks_sharded": sum(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel"))
                                      for m in rw.unwrap().model.layers),
        })
    trainer.train()
    obs.update({
        "policy_backend": wrapkit.adapt(trainer.model_wrapped).backend,
        "policy_trainable": sum(p.requires_grad for p in trainer.model.parameters()),
        "train_modes": trainer.train_modes,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "kl": [h["kl"] for h in trainer.state.log_history if "kl" in h],
    })
    if rw is not None:
        obs["ref_eval"] = not any(m.training for m in ref.modules())
        obs["ref_resident"] = rw.resident_parameter_bytes() / (rw.num_parameters() * 4)  # of the float32 model
    report_and_close(obs, a.json)


if __name__ == "__main__":
    main()
