"""TRL's real ``AsyncGRPOTrainer`` syncing to a real vLLM server through ``VLLMEngine`` as its ``weight_transfer``
(TRL's ``WeightTransferProtocol``), on two CPU ranks, with ``patch_trl()``.

    torchrun --nproc_per_node 2 tests/vllm/trainers/trl_async.py --backend fsdp2 --model DIR --url URL \
        --group-port P --json OUT

The trainer's own training step cannot run on a CPU: its forward packs samples into a prefix tree whose attention
is a CUDA kernel fetched from the Hub (FlashAttention 3). Its weight sync is what runs, as its callbacks run it:
``init_weight_transfer()`` on the main process at the start, then ``_sync_weight()`` on every rank, around real
optimizer steps of the prepared policy (its forward through the wrapper in PyTorch's attention). After each sync
the server's greedy tokens and log-probabilities on fixed prompts are compared with the policy's own (its full
weights gathered into a plain model); ``--no-sync`` leaves the server behind, which must fail the comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vllm.trainers.trl_loop import LAYERS, lora_config, parser  # noqa: E402


def _served(url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as answer:
        return str(json.load(answer)["data"][0]["id"])


def _plain_copy(prepared: Any, family: str, lora: bool) -> Any:
    """The policy's current weights in a fresh plain model (LoRA merged on that copy), for the oracle."""
    import wrapkit
    from tests.vllm.server import tiny_model

    state = wrapkit.adapt(prepared).full_state_dict(rank0_only=False)
    model = tiny_model(family)
    if lora:
        from peft import PeftModel

        peft = PeftModel(model, lora_config())
        peft.load_state_dict(state)
        return peft.merge_and_unload().eval()
    model.load_state_dict(state)
    return model.eval()


def main() -> None:
    a = parser(steps=3).parse_args()  # steps: syncs, with an optimizer step after each

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from tests.harness.launch import report_and_close
    from tests.integrations import accelerate_cpu
    from tests.vllm.scenarios_real import NEW_TOKENS, PROMPTS, served
    from tests.vllm.server import compared, greedy
    from wrapkit.integrations._trl_async import sync_weight_merged
    from wrapkit.integrations.engines import _vllm_engine
    from wrapkit.integrations.trl import patch_trl

    patch_trl()
    # Its constructor reads the GPU's name for a throughput metric (peak FLOPs), which a CPU has not.
    import trl.experimental.async_grpo.async_grpo_trainer as async_trainer

    async_trainer.get_peak_flops_per_device = lambda *_: 1.0
    args = AsyncGRPOConfig(
        output_dir=str(Path(a.json).parent / "out"), per_device_train_batch_size=2, max_steps=2,
        report_to="none", save_strategy="no", bf16=False, seed=0, num_generations=2, max_completion_length=8,
        vllm_server_base_url=a.url, vllm_server_timeout=60, dtype="float32",
        **accelerate_cpu.trainer_arguments(a.backend, [LAYERS[a.family]]),
    )
    engine = _vllm_engine.VLLMEngine(a.url, master_port=a.group_port, backend="gloo", timeout=60.0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(a.model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    rows = [{"prompt": [{"role": "user", "content": f"w{i % 8} w{(i + 1) % 8}"}]} for i in range(8)]
    trainer = AsyncGRPOTrainer(model=a.model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                               args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                               peft_config=lora_config() if a.lora else None, weight_transfer=engine)
    policy = trainer.model
    wrapkit_model = policy.base_model.model if a.lora else policy
    wrapkit_model.set_attn_implementation("sdpa")  # for the steps taken here (TRL's own forward needs a GPU)
    # Adam: every trained tensor moves by about the rate each step (LoRA's B starts at zero). DeepSpeed takes the
    # optimizer with the model; FSDP's is built on the parameters it leaves.
    rate = 0.05 if a.lora else 0.01
    if a.backend.startswith("zero"):
        optimizer = torch.optim.Adam([q for q in policy.parameters() if q.requires_grad], lr=rate)
        prepared, optimizer = trainer.accelerator.prepare(policy, optimizer)
    else:
        prepared = trainer.accelerator.prepare(policy)
        optimizer = torch.optim.Adam([q for q in prepared.parameters() if q.requires_grad], lr=rate)
    trainer.model_wrapped = prepared
    obs: dict[str, Any] = {"rounds": [], "own": [], "backend": type(prepared).__name__}
    if trainer.accelerator.is_main_process and not a.no_sync:
        trainer.weight_transfer.init_weight_transfer()  # what its train-begin callback does
    for step in range(a.steps):
        if not a.no_sync:
            trainer._sync_weight()
        dist.barrier()
        # On every rank: under ZeRO-3 transformers' generate() keeps the ranks in step (synced_gpus).
        mine = greedy(_plain_copy(prepared, a.family, a.lora), PROMPTS, NEW_TOKENS)
        if dist.get_rank() == 0:
            obs["rounds"].append(compared(mine, served(a.url, _served(a.url))))
            obs["own"].append(mine)
        ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(step))
        # A step, so that the next sync has news (accelerate's backward: DeepSpeed's engine steps in it).
        trainer.accelerator.backward(prepared(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    obs["model_version"] = trainer.model_version
    obs["patched"] = type(trainer)._sync_weight_merged is sync_weight_merged
    if trainer.accelerator.is_main_process and not a.no_sync:
        trainer.weight_transfer.destroy()
    report_and_close(obs, a.json)


if __name__ == "__main__":
    main()
