"""torchtitan's own Llama3 on two gloo ranks, sharded by torchtitan's ``apply_fsdp_to_decoder`` and stepped by its
``OptimizersContainer``, its state saved in its ``CheckpointManager``'s layout (the model's ``state_dict()`` at the
top level beside the container's own state dict, through its ``ModelWrapper``); then what wrapkit makes of it.
Run by ``tests/test_torchtitan.py`` under torchrun: ``python -m torch.distributed.run --nproc_per_node 2
tests/torchtitan_run.py OUT``; each rank writes ``OUT/rank<r>.json``.

The model is tiny (dim 64, two blocks, vocab 256) and attends through torchtitan's maskless SDPA module: its
flex attention compiles kernels this CPU build does not have.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import wrapkit

VOCAB = 256
TOKENS = torch.arange(16).reshape(2, 8) % VOCAB


def build(fuse_qkv: bool, seed: int) -> nn.Module:
    """torchtitan's Llama3 built from its own configs, as its debug model is, only smaller."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    torch.manual_seed(seed)
    dim, heads = 64, 4
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=256, theta=500000, scaling="llama")
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=2, wqkv_param_init=linear, wo_param_init=linear,
                                  inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse_qkv, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
                                     w1_param_init=linear, w2w3_param_init=linear))
        for _ in range(2)]
    config = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=layers, norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=linear))
    model = config.build()
    model.init_states()
    return model


def trained(fuse_qkv: bool, directory: str) -> tuple[nn.Module, Any]:
    """The model sharded and stepped as torchtitan's trainer does, saved as its CheckpointManager saves."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    model = build(fuse_qkv, seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    for m in model.modules():  # torchtitan sums gradients; gloo has no PREMUL_SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    optimizers = default_adamw(lr=1e-3, implementation="foreach").build(model_parts=[model])
    model(TOKENS).float().pow(2).mean().backward()
    optimizers.step()
    optimizers.zero_grad()
    dcp.save({**ModelWrapper([model]).state_dict(), "optimizer": optimizers}, checkpoint_id=directory)
    return model, optimizers


def main(out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from wrapkit.adapters.dtensor.sharding import unit_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    obs: dict[str, Any] = {}
    ckpt = os.path.join(out, "checkpoint", "step-1")
    model, optimizers = trained(False, ckpt)
    wm = wrapkit.adapt(model)
    obs["backend"] = wm.backend
    # A reference sharded where the policy is (its embedding, each block, [norm, lm_head] together, the root).
    ref = wrapkit.prepare_reference(wm, build(False, seed=0))
    obs["policy_units"] = sorted(sorted(g) for g in unit_groups(model))
    obs["reference_units"] = sorted(sorted(g) for g in unit_groups(ref.module))
    # The policy stepped: the reference (its weights before the step) differs, and a copy makes them equal.
    with torch.no_grad():
        obs["before_copy"] = float((wm(TOKENS) - ref(TOKENS)).abs().max())
        wm.copy_to(ref)
        obs["after_copy"] = float((wm(TOKENS) - ref(TOKENS)).abs().max())
    # torchtitan's checkpoint read into another backend: weights, moments and steps, the learning rate.
    target = wrapkit.adapt(DistributedDataParallel(build(False, seed=1)))
    opt = torch.optim.AdamW(target.module.parameters(), lr=0.5)
    report = target.load_state(ckpt, opt)
    want, got = wm.full_state_dict(rank0_only=False), target.full_state_dict(rank0_only=False)
    obs["weights_equal"] = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    full = StateDictOptions(full_state_dict=True)
    theirs = get_optimizer_state_dict(model, optimizers.optimizers[0], options=full)["state"]
    mine = get_optimizer_state_dict(target.module, opt, options=full)["state"]
    obs["moments_equal"] = theirs.keys() == mine.keys() and all(
        torch.equal(theirs[k][s], mine[k][s]) for k in theirs for s in ("exp_avg", "exp_avg_sq", "step"))
    obs["lr"] = [g["lr"] for g in opt.param_groups]
    obs["skipped"] = report.skipped
    # The fused attention projection: its state-dict hooks save wqkv as wq/wk/wv, which wrapkit does not follow
    # yet; a load is refused, never misread.
    fused_dir = os.path.join(out, "fused", "step-1")
    trained(True, fused_dir)
    other = wrapkit.adapt(DistributedDataParallel(build(True, seed=1)))
    try:
        other.load_state(fused_dir)
        obs["fused"] = "no error"
    except wrapkit.StateDictError as exc:
        obs["fused"] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(obs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
