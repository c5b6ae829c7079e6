"""ms-swift's own RLHF pipelines (``swift.pipelines.rlhf_main``: DPO, GRPO) for a few steps on two
CPU ranks, with or without wrapkit's drop-ins patched in; several pipelines run one after the
other in the same launch.

    torchrun --nproc_per_node 2 tests/integrations/swift_run.py --backend zero3 --trainer dpo grpo \
        --model DIR --data FILE --json OUT

``DIR`` holds a tiny Llama and a byte-level BPE tokenizer saved by ``save_tiny``, ``FILE`` the
preference rows written by ``write_rows`` (nothing is downloaded). Rank 0 writes, per pipeline,
what both ranks observed to ``OUT``: the losses, the training flag of every module at every loss
computation (the backward follows it with no mode change in between), and the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS = 2
_WORDS = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sits", "flies", "the", "a", "big", "small"]


def save_tiny(path: str | Path, heads: int = 4) -> None:
    """A 2-layer Llama and a byte-level BPE tokenizer trained on a made-up corpus, saved with
    ``save_pretrained``. ``heads``: attention heads (2 for vLLM's CPU build, which refuses a head size of 16)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(_WORDS[(i * k) % len(_WORDS)] for k in range(1, 9)) for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def write_rows(path: str | Path, n: int = 16) -> None:
    """Preference rows in ms-swift's format: messages with the chosen answer, and the rejected one."""
    with open(path, "w") as f:
        for i in range(n):
            a, b, c = (_WORDS[(i + k) % len(_WORDS)] for k in (0, 3, 7))
            row = {"messages": [{"role": "user", "content": f"the {a} {b}"},
                                {"role": "assistant", "content": f"a {c} {a} sits"}],
                   "rejected_response": f"{b} {b} flies big"}
            f.write(json.dumps(row) + "\n")


def _fsdp2_config(path: Path) -> str:
    """ms-swift's FSDP2 preset without what a CPU run cannot use (RAM-efficient loading needs an
    accelerator device to materialise on; activation checkpointing is off to keep the run small)."""
    fsdp_config = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                   "cpu_ram_efficient_loading": False, "state_dict_type": "SHARDED_STATE_DICT",
                   "activation_checkpointing": False}
    cfg = {"fsdp": "full_shard auto_wrap", "fsdp_config": fsdp_config}
    path.write_text(json.dumps(cfg))
    return str(path)


def _generate_then_step(trainer: Any, seen: dict[str, Any], helper: Any) -> dict[str, Any]:
    """Generation between two training steps, as ms-swift's trainers do it: inside ``helper``
    (an ``unwrap_model_for_generation``) the model is put in eval mode the way ms-swift's
    ``TransformersEngine._infer`` does (``self.model.eval()``), then a DPO loss and backward follow."""
    import torch

    import wrapkit

    trainer.model_wrapped.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = batch["input_ids"][:1, :8]
    with helper(trainer.model_wrapped, trainer.accelerator) as m:
        trainer.model.eval()  # what TransformersEngine._infer does to the model it holds
        tokens = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    modules = list(wrapkit.adapt(trainer.model_wrapped).unwrap().modules())
    out = {
        "generated": int(tokens.shape[1] - ids.shape[1]),
        "eval_after_generation": sum(not x.training for x in modules),
        "modules": len(modules),
    }
    count = len(seen["modes"])
    loss = trainer.compute_loss(trainer.model_wrapped, batch)
    trainer.accelerator.backward(loss)
    out["modes_at_next_backward"] = seen["modes"][count:]
    trainer.model_wrapped.train()
    return out


def _toy_reward() -> None:
    from swift.rewards import ORM, orms

    class ToyReward(ORM):
        """How many vowels a completion has: random samples differ, so advantages are not all zero."""

        def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
            return [float(sum(ch in "aeiou" for ch in c)) for c in completions]

    orms["toy_vowels"] = ToyReward


def _run(kind: str, a: argparse.Namespace, out: Path, helpers: dict[str, Any], patched: list[str]) -> dict[str, Any]:
    """One of ms-swift's RLHF pipelines (``kind``: dpo or grpo) for ``a.steps`` steps; what this rank saw."""
    import wrapkit
    from tests.integrations import accelerate_cpu

    if kind == "dpo":
        from swift.rlhf_trainers.dpo_trainer import DPOTrainer as Trainer
    else:
        from swift.rlhf_trainers.grpo_trainer import GRPOTrainer as Trainer
    # accelerate sees no accelerator here: set up the CPU state its device check would have set
    # (tests/integrations/accelerate_cpu.py); ms-swift's trainer then uses it as configured. Set afresh for each
    # pipeline, as a new process would have it.
    accelerate_cpu.trainer_arguments(a.backend)
    seen: dict[str, Any] = {"modes": [], "trainer": None}
    compute_loss = Trainer.compute_loss

    def recording(self: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # Every module of the policy, read at each loss computation: the backward follows.
        seen["trainer"] = self
        seen["modes"].append(all(m.training for m in wrapkit.adapt(model).unwrap().modules()))
        return compute_loss(self, model, inputs, *args, **kwargs)

    Trainer.compute_loss = recording  # type: ignore[method-assign]

    from swift.pipelines import rlhf_main

    argv = [
        "--rlhf_type", kind, "--model", a.model, "--model_type", "llama", "--template", "default",
        "--dataset", a.data, "--tuner_type", "full", "--torch_dtype", "float32", "--max_steps", str(a.steps),
        "--per_device_train_batch_size", "2", "--max_length", "64", "--save_strategy", "no",
        "--split_dataset_ratio", "0", "--dataset_num_proc", "1", "--report_to", "none", "--logging_steps", "1",
        "--learning_rate", "1e-3", "--fp16", "false", "--bf16", "false", "--output_dir", str(out / f"out-{kind}"),
        "--accelerator_config", json.dumps({"use_configured_state": True}), "--ddp_backend", "gloo", "--seed", "0",
    ]
    if kind == "grpo":
        argv += ["--num_generations", "2", "--max_completion_length", "4", "--reward_funcs", "toy_vowels",
                 "--use_vllm", "false", "--beta", "0.04"]
    if a.backend == "zero3":
        argv += ["--deepspeed", "zero3"]
    else:
        argv += ["--fsdp", _fsdp2_config(out / "fsdp2.json")]
    error = None
    try:
        rlhf_main(argv)
    except Exception as exc:  # the unpatched run may fail: report it, as the test compares both
        error = f"{type(exc).__name__}: {exc}"
    trainer = seen["trainer"]
    obs: dict[str, Any] = {"patched": patched, "error": error, "modes": list(seen["modes"])}
    if trainer is not None and error is None and kind == "dpo":
        obs["generation"] = {name: _generate_then_step(trainer, seen, h) for name, h in helpers.items()}
    Trainer.compute_loss = compute_loss  # type: ignore[method-assign]
    # The trainer modules were imported after the patch, and still see the drop-ins.
    import swift.rlhf_trainers.rlhf_mixin as mixin
    import swift.rlhf_trainers.rollout_mixin as rollout

    from wrapkit.integrations import swift as swift_dropins
    from wrapkit.integrations import trl as trl_dropins

    obs["sees_wrapkit"] = {
        "rlhf_mixin.prepare_deepspeed": mixin.prepare_deepspeed is trl_dropins.prepare_deepspeed,
        "rollout_mixin.unwrap_model_for_generation":
            rollout.unwrap_model_for_generation is swift_dropins.unwrap_model_for_generation,
        "rollout_mixin.prepare_deepspeed": rollout.prepare_deepspeed is swift_dropins.prepare_deepspeed,
    }
    if trainer is not None:
        ref = trainer.ref_model
        policy = wrapkit.adapt(trainer.model_wrapped)
        obs.update({
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            "policy_backend": policy.backend,
            "policy_sharded": policy.is_sharded,
            "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        })
        if ref is not None:
            rw = wrapkit.adapt(ref)
            obs.update({"ref_type": type(ref).__name__, "ref_backend": rw.backend, "ref_sharded": rw.is_sharded,
                        "ref_zero_stage": rw.zero_stage,
                        "ref_eval": not any(m.training for m in rw.unwrap().modules())})
    return obs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["dpo", "grpo"], nargs="+", default=["dpo"],
                   help="the pipelines to run, one after the other in the same processes")
    p.add_argument("--backend", choices=["zero3", "fsdp2"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-patch", dest="patch", action="store_false")
    a = p.parse_args()
    out = Path(a.json).parent

    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu

    accelerate_cpu.trainer_arguments(a.backend)
    import swift.utils.transformers_utils

    helpers = {"ms-swift": swift.utils.transformers_utils.unwrap_model_for_generation}
    patched: list[str] = []
    if a.patch:
        from wrapkit.integrations.swift import patch_swift

        patched = [f"{m.__name__}.{n}" for m, n, _ in patch_swift().swaps]
        helpers["wrapkit"] = swift.utils.unwrap_model_for_generation  # what ms-swift's trainers now call
    if "grpo" in a.trainer:
        _toy_reward()
    # One launch for several pipelines: starting ranks that import ms-swift costs more than a short run.
    report_and_close({kind: _run(kind, a, out, helpers, patched) for kind in a.trainer}, a.json)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    main()
