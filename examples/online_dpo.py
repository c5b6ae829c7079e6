"""A small online-DPO trainer written against wrapkit's public API.

Every step, each rank samples two completions per prompt from the current policy, scores them with a toy
reward, and takes one DPO step on the (chosen, rejected) pairs against a frozen reference. Every
``--sync-every`` steps the reference is pulled towards the policy (the TR-DPO soft update). The training
loop is the same for every backend; only the wrapping at the top differs.

    torchrun --nproc_per_node 2 examples/online_dpo.py --backend zero3 --steps 30

The model is a tiny transformers Llama built from a config, so nothing is downloaded. The toy reward is
the number of completion tokens whose id falls in the lower eighth of the vocabulary: random sampling
scores about one token in eight, so a rising reward shows that the policy learned the preference.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import wrapkit

BACKENDS = ("ddp", "fsdp", "fsdp2", "zero2", "zero3")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="ddp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank per step")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=5, help="soft-update the reference every K steps")
    p.add_argument("--alpha", type=float, default=0.5, help="ref = alpha * policy + (1 - alpha) * ref")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=os.path.join(tempfile.gettempdir(), "online_dpo", "policy.safetensors"))
    p.add_argument("--json", default=None, help="write a summary of the run to this file")
    return p.parse_args()


def tiny_llama() -> torch.nn.Module:
    """A 2-layer Llama built from a config (nothing downloaded), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def wrap(backend: str, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """The tiny Llama wrapped for ``backend``, and the optimizer (None: the DeepSpeed engine owns it)."""
    model = tiny_llama()
    if backend.startswith("zero"):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(backend[4:])},
            # torch's AdamW: DeepSpeed's fused CPU Adam would need a C++ build.
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine, None
    wrapped: torch.nn.Module
    if backend == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif backend == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                           auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=lr, weight_decay=0.0)


def reward_fn(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Toy reward: how many completion tokens lie in the lowest eighth of the vocabulary."""
    return (completions < vocab // 8).sum(dim=-1).float()


def completion_logps(model: object, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Summed log-probability of each sequence's completion tokens under ``model``."""
    logits = model(sequences).logits[:, prompt_len - 1 : -1].float()  # type: ignore[operator]
    targets = sequences[:, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).sum(-1)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    wrapped, optimizer = wrap(args.backend, args.lr)
    policy = wrapkit.adapt(wrapped)
    ref = wrapkit.prepare_reference(policy)  # no reference given: a frozen copy of the policy
    vocab = policy.config.vocab_size
    if rank == 0:
        print(policy.describe(), flush=True)

    prompt_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # rank-specific prompts
    torch.manual_seed(args.seed * 1000 + rank)  # and rank-specific sampling
    rewards: list[float] = []
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=prompt_gen)
        prompts = prompts.repeat_interleave(2, dim=0).to(policy.device)  # two samples per prompt
        with policy.generation() as m:
            sequences = m.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,  # fixed length: no padding to mask
                pad_token_id=0,
            )
        score = reward_fn(sequences[:, args.prompt_len :], vocab).view(-1, 2)
        first_wins = score[:, 0] >= score[:, 1]
        chosen_idx = torch.arange(args.prompts) * 2 + (~first_wins).long()
        rejected_idx = torch.arange(args.prompts) * 2 + first_wins.long()
        informative = (score[:, 0] != score[:, 1]).float()  # ties carry no preference

        logp = completion_logps(policy, sequences, args.prompt_len)
        with torch.no_grad():
            ref_logp = completion_logps(ref, sequences, args.prompt_len)
        margin = (logp[chosen_idx] - ref_logp[chosen_idx]) - (logp[rejected_idx] - ref_logp[rejected_idx])
        loss = (-F.logsigmoid(args.beta * margin) * informative).sum() / informative.sum().clamp(min=1.0)

        if optimizer is None:
            policy.module.backward(loss)
            policy.module.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if args.sync_every > 0 and (step + 1) % args.sync_every == 0:
            policy.copy_to(ref, alpha=args.alpha)

        stats = torch.tensor([score.mean().item(), loss.item()])
        dist.all_reduce(stats)
        stats /= world
        rewards.append(stats[0].item())
        losses.append(stats[1].item())
        if rank == 0:
            print(f"step {step + 1:3d}  reward {rewards[-1]:.3f}  loss {losses[-1]:.4f}", flush=True)

    elapsed = time.perf_counter() - start
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
    dist.barrier()
    policy.save(args.save)
    if rank == 0:
        print(f"reward first={rewards[0]:.3f} last={rewards[-1]:.3f}  ({elapsed:.1f} s, saved {args.save})")
        if args.json:
            summary = {
                "backend": args.backend,
                "world_size": world,
                "steps": args.steps,
                "rewards": rewards,
                "losses": losses,
                "seconds": elapsed,
                "checkpoint": os.path.abspath(args.save),
            }
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    # The end of every rank: destroys the group and exits 0, without the abort at interpreter exit
    # that gloo's threads can cause once a DDP wrapper has existed (see wrapkit/shutdown.py).
    wrapkit.shutdown()


if __name__ == "__main__":
    main()
