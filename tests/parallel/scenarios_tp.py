"""Tensor parallelism alone: a Llama with ``parallelize_module`` (ColwiseParallel on q/k/v/gate/up,
RowwiseParallel on o/down) on every rank of the group, and every operation checked against the same
model unsharded. Each rank's slice of a sharded weight differs from the others', so a result built
from one rank's slice cannot pass."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128
PROMPT = torch.tensor([[1, 5, 9, 2]])


TP_SIZE = 2  # the tiny Llama's two key/value heads split over at most two ranks


def _parallelized(seed: int, dtype: torch.dtype = torch.float32, producer: str = "torch",
                 tmp: str = "") -> torch.nn.Module:
    """``tiny_llama(seed)`` tensor parallel over two ranks: the whole group, or on four ranks the ``tp``
    dimension of a (dp, tp) mesh, where each dp slice holds a model of its own. ``producer="transformers"``:
    loaded by ``from_pretrained(..., tp_plan="auto")`` from a checkpoint rank 0 writes into ``tmp``.
    ``producer="fsdp2"``: then ``fully_shard`` per block over the ``dp`` dimension, one model over every rank.
    ``producer="hsdp"``: on eight ranks, a (replicate, shard, tp) mesh of 2 x 2 x 2, FSDP2 over the first two.
    ``producer="transformers-fsdp2"``: transformers' own ``DistributedConfig(tp_size=2, fsdp_size=...)``;
    ``"transformers-sp"``: ``DistributedConfig(tp_size=2, enable_sequence_parallel=True)``, activations
    between the split layers cut along the sequence."""
    if producer.startswith("transformers"):
        from transformers import LlamaForCausalLM
        from transformers.distributed import DistributedConfig

        directory = os.path.join(tmp, f"checkpoint-{seed}")
        if dist.get_rank() == 0 and not os.path.isdir(directory):
            tiny_llama(seed).save_pretrained(directory)
        dist.barrier()
        how: dict[str, Any] = {"tp_plan": "auto"}
        if producer == "transformers-fsdp2":
            how = {"distributed_config": DistributedConfig(tp_size=TP_SIZE, fsdp_size=dist.get_world_size() // TP_SIZE)}
        elif producer == "transformers-sp":
            how = {"distributed_config": DistributedConfig(tp_size=TP_SIZE, enable_sequence_parallel=True)}
        model: torch.nn.Module = LlamaForCausalLM.from_pretrained(directory, dtype=dtype, **how)
        return model.train()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if producer == "hsdp":
        root = init_device_mesh("cpu", (world // (2 * TP_SIZE), 2, TP_SIZE),
                                mesh_dim_names=("replicate", "shard", "tp"))
    else:
        root = init_device_mesh("cpu", (world // TP_SIZE, TP_SIZE), mesh_dim_names=("dp", "tp"))
    mesh = root["tp"]
    model = tiny_llama(seed).to(dtype)
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    if producer == "fsdp2":
        from wrapkit.adapters.dtensor.sharding import fully_shard_per_block

        fully_shard_per_block(model, root["dp"])
    elif producer == "hsdp":
        from wrapkit.adapters.dtensor.sharding import fully_shard_per_block

        fully_shard_per_block(model, root["replicate", "shard"])
    return model


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _logits(out: Any) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).detach().float()


def operations(tmp: str, dtype_name: str, producer: str = "torch") -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)

    def parallelized(seed: int, dtype: torch.dtype) -> torch.nn.Module:
        return _parallelized(seed, dtype, producer, tmp)

    wm = wrapkit.adapt(parallelized(0, dtype))
    plain = tiny_llama(0).to(dtype).eval()
    if producer.startswith("transformers"):  # the same loading path, without the plan (the same attention kernel)
        from transformers import LlamaForCausalLM

        plain = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "checkpoint-0"), dtype=dtype).eval()
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    obs: dict[str, Any] = {"backend": wm.backend, "is_sharded": wm.is_sharded, "stack": wm.stack,
                           "world_size": wm.world_size, "rank": wm.rank, "global_rank": dist.get_rank(),
                           "data_parallel": (wm.data_parallel_rank, wm.data_parallel_size),
                           "num_parameters": wm.num_parameters() == sum(p.numel() for p in plain.parameters())}
    q: Any = wm.unwrap().model.layers[0].self_attn.q_proj.weight
    obs["split"] = q.to_local().shape[0] * wm.world_size == q.shape[0]
    with torch.no_grad():
        want_logits = _logits(plain(TOKENS))
        want_tokens = plain.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
        obs["tp_forward"] = float((_logits(wm(TOKENS)) - want_logits).abs().max())
    # Adapted again right after a no-grad forward (FSDP2 keeps the root unsharded then: its split layers
    # lie on the tp dimension alone).
    obs["adapt_after_forward"] = wrapkit.adapt(wm.module).backend == wm.backend

    obs["full_state_dict"] = _equal(wm.full_state_dict(rank0_only=False), want)
    obs["named_full"] = _equal({n: t.clone() for n, t in wm.named_full_parameters()},
                               dict(plain.named_parameters()))
    with wm.gathered() as m, torch.no_grad():
        obs["gathered_plain_params"] = not any(type(p).__name__ == "DTensor" for p in m.parameters())
        obs["gathered_forward"] = float((_logits(m(TOKENS)) - want_logits).abs().max())
    for gather in ("full", "layerwise"):
        with wm.generation(gather=gather) as m:
            obs[f"generation_{gather}"] = m.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist() == want_tokens
    receiver = tiny_llama(9).to(dtype)
    got = {name: t.clone() for bucket in wm.stream_full_parameters(bucket_bytes=4096)
           for name, t in bucket.named_tensors()}
    obs["stream"] = _equal(got, dict(plain.named_parameters()))

    # Out to a plain model and back in from another one, then shard to shard.
    target = wrapkit.adapt(receiver)
    wm.copy_to(target)
    obs["copy_to_plain"] = _equal(dict(receiver.state_dict()), want)
    other = wrapkit.adapt(parallelized(3, dtype))
    wrapkit.adapt(tiny_llama(0).to(dtype)).copy_to(other)
    obs["copy_from_plain"] = _equal(other.full_state_dict(rank0_only=False), want)
    third = wrapkit.adapt(parallelized(4, dtype))
    wm.copy_to(third)
    obs["copy_tp_to_tp"] = _equal(third.full_state_dict(rank0_only=False), want)

    # Files: save_pretrained read back by transformers, and load into another parallelized model.
    # Each model (tensor parallel alone: each dp slice) has its own files; a model's ranks are consecutive.
    # HSDP's copies are one model: the first copy writes, every copy reads.
    tmp = os.path.join(tmp, "model" if producer == "hsdp" else f"model{dist.get_rank() - wm.rank}")
    os.makedirs(tmp, exist_ok=True)
    directory = os.path.join(tmp, f"tp-{dtype_name}")
    wm.save_pretrained(directory, max_shard_size="20KB")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    obs["files"] = len(files)
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    obs["from_pretrained"] = _equal(dict(back.state_dict()), want)
    fresh = wrapkit.adapt(parallelized(5, dtype))
    fresh.load(directory)
    obs["load_dir"] = _equal(fresh.full_state_dict(rank0_only=False), want)
    path = os.path.join(tmp, f"tp-{dtype_name}.safetensors")
    wm.save(path)
    again = wrapkit.adapt(parallelized(6, dtype))
    again.load(path)
    obs["save_load_file"] = _equal(again.full_state_dict(rank0_only=False), want)
    again.load_full_state_dict(tiny_llama(7).to(dtype).state_dict())
    obs["load_full_state_dict"] = _equal(again.full_state_dict(rank0_only=False), tiny_llama(7).to(dtype).state_dict())

    # A write on rank 0 of the group inside gathered(modifier_rank=0) reaches every rank's shards and
    # plain copies.
    with wm.gathered(modifier_rank=0) as m, torch.no_grad():
        if wm.rank == 0:
            m.model.layers[0].self_attn.q_proj.weight.add_(1.0)
            m.model.norm.weight.add_(1.0)
    after = wm.full_state_dict(rank0_only=False)
    changed = {k for k in after if not torch.equal(after[k], want[k])}
    obs["changed"] = sorted(changed)
    obs["modifier_write"] = changed == {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"} and bool(
        torch.equal(after["model.norm.weight"], want["model.norm.weight"] + 1.0))
    obs["place"] = wm.place("cpu") is wm

    # A reference: the user's own model parallelized the same way is taken as it is, frozen; a
    # frozen copy built by wrapkit is refused, naming the backend and the fix.
    ref = wrapkit.prepare_reference(wm, parallelized(0, dtype))
    with torch.no_grad():
        obs["reference"] = (ref.backend == wm.backend and ref.num_parameters(trainable_only=True) == 0
                            and not any(m.training for m in ref.module.modules()))
        obs["reference_forward"] = float((_logits(ref(TOKENS)) - want_logits).abs().max())
    # Where transformers distributed the model it recorded how, and the frozen copy is laid out the same way.
    try:
        fresh = wrapkit.prepare_reference(wm)
        with torch.no_grad():
            diff = float((_logits(fresh(TOKENS)) - _logits(wm(TOKENS))).abs().max())
        frozen = fresh.num_parameters(trainable_only=True) == 0 and not any(m.training for m in fresh.module.modules())
        obs["fresh_reference"] = f"built {fresh.backend} frozen={frozen} diff={diff}"
    except wrapkit.UnsupportedModelError as exc:
        obs["fresh_reference"] = str(exc)

    # sleep/wake with a torch optimizer that has state: everything back, the values unchanged.
    opt = torch.optim.AdamW(wm.module.parameters(), lr=1e-3)
    wm(TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    before = wm.full_state_dict(rank0_only=False)
    wm.sleep(opt)
    wm.wake()
    obs["sleep_wake"] = _equal(wm.full_state_dict(rank0_only=False), before)
    obs["describe"] = wm.describe()
    return obs


def accelerate_tp(tmp: str) -> dict[str, Any]:
    """accelerate's ``ParallelismConfig(tp_size=2)`` on two GPUs (on CPU gloo accelerate refuses it): the model
    loaded with transformers' plan on accelerate's ``tp`` mesh, then ``prepare``d; adapted as tp, its full
    weights and greedy tokens the unsharded model's."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import LlamaForCausalLM

    directory = os.path.join(tmp, "checkpoint-accelerate")
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        tiny_llama(0).save_pretrained(directory)
    dist.barrier()
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=TP_SIZE))
    model = LlamaForCausalLM.from_pretrained(directory, tp_plan="auto",
                                             device_mesh=accelerator.torch_device_mesh["tp"])
    wm = wrapkit.adapt(accelerator.prepare(model))
    plain = LlamaForCausalLM.from_pretrained(directory).to(accelerator.device).eval()
    prompt = PROMPT.to(accelerator.device)
    with torch.no_grad():
        want = plain.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    with wm.generation() as m:
        got = m.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    return {"backend": wm.backend, "world_size": wm.world_size, "tokens": got == want,
            "weights": _equal(wm.full_state_dict(rank0_only=False), plain.state_dict())}
