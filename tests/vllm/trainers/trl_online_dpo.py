"""TRL's real ``OnlineDPOTrainer`` (``trl.experimental``) for a few steps on two CPU ranks, in its colocate mode: an
engine of vLLM's CPU build in each rank's process, loaded by the trainer's own sync (``_move_model_to_vllm``, on
wrapkit's stream under ``patch_trl()``).

    torchrun --nproc_per_node 2 tests/vllm/trainers/trl_online_dpo.py --backend fsdp2 --model DIR --url - \
        --group-port P --json OUT --colocate

After each sync (one per step, before its generation) the engine's greedy tokens and log-probabilities on fixed
prompts are compared with the policy's own (its full weights gathered into a plain model). ``--no-sync`` leaves
the engine with the weights it started from, which must fail the comparison once the policy has moved.
(TRL's server mode of this trainer cannot be built on a CPU: its constructor asks for the accelerator's device.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vllm.trainers.trl_async import _plain_copy  # noqa: E402
from tests.vllm.trainers.trl_loop import LAYERS, _reward, lora_config, parser  # noqa: E402


def _engine_greedy(llm: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """The in-process engine's greedy tokens for each prompt and their log-probabilities."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [float(lp[t].logprob) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
            for o in outs]


def main() -> None:
    p = parser(steps=3)
    p.add_argument("--colocate", action="store_true")
    a = p.parse_args()

    import functools

    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu
    from tests.vllm.scenarios_real import NEW_TOKENS, PROMPTS
    from tests.vllm.server import compared, greedy
    from wrapkit.integrations.trl import patch_trl

    patched = patch_trl()
    import trl.experimental.online_dpo.online_dpo_trainer as online_dpo

    # TRL gives its engine no dtype (a float32 checkpoint is served in 16 bits): the trainer's, as the check is of
    # the sync. The engine tokenizes the prompts' text here: the word-level tokenizer saved alone (server.trl_dir).
    online_dpo.LLM = functools.partial(online_dpo.LLM, dtype="float32", enforce_eager=True,
                                       tokenizer=str(Path(a.model) / "tokenizer"))
    trainer_class = online_dpo.OnlineDPOTrainer
    move = trainer_class._move_model_to_vllm
    obs: dict[str, Any] = {"rounds": [], "own": [], "patched": any(m[1] == "_move_model_to_vllm"
                                                                  for m in patched.methods)}

    def checked(self: Any) -> None:
        if not a.no_sync:
            move(self)
        mine = greedy(_plain_copy(self.model_wrapped, a.family, a.lora), PROMPTS, NEW_TOKENS)
        seen = compared(mine, _engine_greedy(self.llm, PROMPTS, NEW_TOKENS))
        obs["rounds"].append(seen)
        obs["own"].append(mine)
        obs["backend"] = type(self.model_wrapped).__name__

    trainer_class._move_model_to_vllm = checked  # type: ignore[method-assign]
    args = online_dpo.OnlineDPOConfig(
        output_dir=str(Path(a.json).parent / "out"), per_device_train_batch_size=2, max_steps=a.steps,
        learning_rate=0.05 if a.lora else 0.01, report_to="none", logging_steps=1, save_strategy="no",
        bf16=False, seed=0, max_new_tokens=8, max_length=64, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        # TRL loads the policy with device_map="auto" by default, which transformers refuses under ZeRO-3.
        model_init_kwargs={"device_map": None} if a.backend == "zero3" else None,
        **accelerate_cpu.trainer_arguments(a.backend, [LAYERS[a.family]]),
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(a.model)
    rows = [{"prompt": f"w{i % 8} w{(i + 1) % 8} w{(i + 2) % 8}"} for i in range(32)]
    # The reference model given (TRL's copy of the policy is refused under ZeRO-3); with LoRA there is none.
    ref = None if a.lora else AutoModelForCausalLM.from_pretrained(a.model)
    trainer = trainer_class(model=a.model, ref_model=ref, reward_funcs=_reward, args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                            peft_config=lora_config() if a.lora else None)
    trainer.train()
    dist.barrier()
    report_and_close(obs, a.json)


if __name__ == "__main__":
    main()
