"""torchtitan's own Llama3 on two gloo ranks, sharded by torchtitan's ``apply_fsdp_to_decoder`` and stepped by its
``OptimizersContainer``, its state saved in its ``CheckpointManager``'s layout (the model's ``state_dict()`` at the
top level beside the container's own state dict, through its ``ModelWrapper``); then what wrapkit makes of it.
Run by ``tests/integrations/test_torchtitan.py`` under torchrun: ``python -m torch.distributed.run --nproc_per_node 2
tests/integrations/torchtitan_run.py OUT``; each rank writes ``OUT/rank<r>.json``.

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


def qwen3(moe: bool, seed: int, configure: Any = None) -> nn.Module:
    """torchtitan's Qwen3 debug model (tied, q/k norms) or its mixture of experts, two blocks, attending through
    SDPA, the mixture cut to 8 experts (top 2)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs["debugmodel_moe" if moe else "debugmodel"](attn_backend="flex")
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if moe:
            experts, router = layer.moe.routed_experts, layer.moe.router
            layer.moe.num_experts = router.num_experts = router.gate.out_features = 8
            experts.inner_experts.num_experts = experts.token_dispatcher.num_experts = 8
            router.top_k = experts.token_dispatcher.top_k = 2
    if configure is not None:  # what torchtitan's trainer sets on the config before building (sharding)
        configure(config)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def deepseek_v3(seed: int) -> nn.Module:
    """torchtitan's DeepSeek-V3 debug model (latent attention, a dense block then a mixture), two blocks, through
    SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    config = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def sharded(model: nn.Module, apply: Any = None) -> nn.Module:
    """``model`` sharded by torchtitan's own FSDP recipe over every rank (``apply``: the recipe called otherwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    if apply is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    else:
        apply(model)
    for m in model.modules():  # torchtitan sums gradients; gloo has no PREMUL_SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def hub_files(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``, by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, f)).items()}


def loads_theirs(wm: Any, adapter: Any, other: nn.Module, directory: str) -> dict[str, Any]:
    """A Hub directory torchtitan's own ``to_hf`` wrote of ``other``'s state dict, loaded into ``wm``: what the
    load reported, and whether ``wm`` then holds ``other``'s state dict."""
    from safetensors.torch import save_file

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in adapter.to_hf(dict(other.state_dict())).items()},
                  os.path.join(directory, "model.safetensors"))
    dist.barrier()
    report = list(wm.load(directory))
    got = wm.full_state_dict(rank0_only=False)
    return {"load": report, "loaded_equal": all(torch.equal(got[k], v) for k, v in other.state_dict().items())}


def hub_checks(make: Any, out: str) -> dict[str, Any]:
    """One torchtitan model sharded by torchtitan, in the Hub's layout, against torchtitan's own ``to_hf`` of the
    unsharded model's state dict and transformers' model of the ``config.json`` written beside it."""
    import transformers

    from wrapkit.formats.torchtitan import titan_layout
    from wrapkit.integrations.vllm import load_into

    whole = make(0)
    wm = wrapkit.adapt(sharded(make(0)))
    layout = titan_layout(whole)
    adapter = type(layout.to_hub.__self__)(whole.config, None)  # torchtitan's own adapter, built as its trainer does
    want = adapter.to_hf(dict(whole.state_dict()))
    obs: dict[str, Any] = {}
    saved = os.path.join(out, "saved")
    wm.save_pretrained(saved)
    files = hub_files(saved)
    obs["save_keys"] = sorted(files) == sorted(want)
    obs["save_values"] = all(torch.equal(files[k], want[k]) for k in want if k in files)
    # A stream carries the parameters (DeepSeek-V3's expert biases are buffers, which only the files hold).
    buffers = {n for n, _ in whole.named_buffers()}
    want_params = adapter.to_hf({k: v for k, v in whole.state_dict().items() if k not in buffers})
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=2**20) for n, t in b.named_tensors()}
    obs["stream"] = sorted(streamed) == sorted(want_params) and all(
        torch.equal(streamed[k], want_params[k]) for k in want_params)
    tokens = TOKENS % whole.config.vocab_size
    obs["config"] = os.path.exists(os.path.join(saved, "config.json"))
    if obs["config"]:
        hub = transformers.AutoModelForCausalLM.from_pretrained(saved)
        # What a colocated engine gets: the default stream fed into a transformers model of that config.
        fed = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(saved))
        load_into(fed, wm.stream_full_parameters(bucket_bytes=2**20))
        with torch.no_grad():
            obs["hf_logits"] = float((hub(tokens).logits - whole(tokens)).abs().max())
            obs["fed_logits"] = float((fed(tokens).logits - whole(tokens)).abs().max())
    # A Hub directory written by torchtitan's own to_hf (another model's weights) loaded into the sharded one.
    obs.update(loads_theirs(wm, adapter, make(7), os.path.join(out, "theirs")))
    obs["delta"] = deltas(wm)
    return obs


def deltas(wm: Any) -> list[Any]:
    """``DeltaSync`` of the sharded model to vLLM's sparse receiver (the tests' stand-in, on rank 0): a dense sync,
    then two sparse ones with every rank's own values moved between; per sync, which way it was diffed, why it
    gathered, whether it sent fewer values than the model has, and (rank 0) the tensors the receiver holds that
    differ from a dense stream of the same moment."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the stand-in, from the repository
    from tests.engines import vllm_standin as vs
    from wrapkit.integrations.vllm import DeltaSync

    transfer = vs.TransferGroup() if dist.get_rank() == 0 else None
    sender = vs.SparseSender(transfer) if transfer is not None else None
    delta = DeltaSync(wm, dtype=torch.bfloat16, bucket_bytes=2**16, dense_every=None)
    out: list[Any] = []
    try:
        for step in range(3):
            if step:
                with torch.no_grad():
                    for p in wm.unwrap().parameters():
                        local = p.to_local() if hasattr(p, "to_local") else p
                        local.view(-1)[:: 5 + step].add_(0.01)  # alike on every rank: replicas stay replicas
            report = delta.send(sender)
            stream = wm.stream_full_parameters(2**16, torch.bfloat16)
            want = {n: t.clone() for b in stream for n, t in b.named_tensors()}
            held = sender.held if sender is not None else want
            wrong = sorted(n for n in want if n not in held or not torch.equal(held[n], want[n]))
            out.append([report.diffed, report.why, report.changed < report.values, wrong])
    finally:
        if transfer is not None:
            transfer.close()
    return out


def trained(model: nn.Module, directory: str) -> tuple[nn.Module, Any]:
    """``model`` sharded and stepped as torchtitan's trainer does, saved as its CheckpointManager saves."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer import default_adamw

    model = sharded(model)
    optimizers = default_adamw(lr=1e-3, implementation="foreach").build(model_parts=[model])
    model(TOKENS % model.config.vocab_size).float().pow(2).mean().backward()
    optimizers.step()
    optimizers.zero_grad()
    dcp.save({**ModelWrapper([model]).state_dict(), "optimizer": optimizers}, checkpoint_id=directory)
    return model, optimizers


def moments(module: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state by name, whole (torch's get_optimizer_state_dict cannot read a model with
    state-dict hooks). Read before a forward: one leaves FSDP2's last unit unsharded, its parameters other
    objects than the optimizer's."""
    return {name: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in optimizer.state[p].items()}
            for name, p in module.named_parameters()}


def same_moments(theirs: dict[str, dict[str, torch.Tensor]], mine: dict[str, dict[str, torch.Tensor]]) -> bool:
    return theirs.keys() == mine.keys() and all(v for v in theirs.values()) and all(
        torch.equal(theirs[k][s].cpu(), mine[k][s].cpu()) for k in theirs for s in ("exp_avg", "exp_avg_sq", "step"))


def resumes(make: Any, out: str) -> dict[str, Any]:
    """A model of torchtitan's sharded and stepped by torchtitan, its CheckpointManager checkpoint read into DDP
    by load_state (weights and moments against torchtitan's), and a reference sharded at its units."""
    from torch.nn.parallel import DistributedDataParallel

    from wrapkit.adapters.dtensor.sharding import unit_groups

    model, optimizers = trained(make(0), out)
    theirs = moments(model, optimizers.optimizers[0])
    wm = wrapkit.adapt(model)
    target = wrapkit.adapt(DistributedDataParallel(make(1)))
    opt = torch.optim.AdamW(target.module.parameters(), lr=0.5)
    target.load_state(out, opt)
    want, got = wm.full_state_dict(rank0_only=False), target.full_state_dict(rank0_only=False)
    ref = wrapkit.prepare_reference(wm, make(0))
    return {"weights_equal": want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want),
            "moments_equal": same_moments(theirs, moments(target.module.module, opt)),
            "units": sorted(sorted(g) for g in unit_groups(ref.module)) == sorted(
                sorted(g) for g in unit_groups(model))}


def expert_parallel(out: str) -> dict[str, Any]:
    """torchtitan's expert parallelism as its trainer sets it up: the Qwen3-MoE config given its sharding config
    with EP on (``set_qwen3_sharding_config``), its ``parallelize`` over ``ep`` = 2 with the ``partial_dtensor``
    backend, then its FSDP recipe with the experts' own ``efsdp`` mesh (each rank holds 4 of the 8 experts). Every
    operation against the unsharded model and torchtitan's ``to_hf``; a step of it and its checkpoint resumed on
    DDP and on the same layout."""
    import torch.distributed.checkpoint as dcp
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.nn.parallel import DistributedDataParallel
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    from wrapkit.formats.torchtitan import titan_layout

    # torchtitan builds its meshes on "cuda" where it finds no accelerator: on this CPU machine, on "cpu".
    parallel_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=2,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()

    def built(seed: int) -> nn.Module:
        model = qwen3(True, seed=seed, configure=lambda c: set_qwen3_sharding_config(c, enable_sp=False,
                                                                                     enable_ep=True))
        model.parallelize(dims)
        return sharded(model, apply=lambda m: apply_fsdp_to_decoder(
            m, dims.get_mesh(["fsdp"]), param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False,
            ep_degree=2, edp_mesh=dims.get_optional_mesh(["efsdp"])))

    whole = qwen3(True, seed=0)
    model = built(0)
    # Built first, as its trainer does: a no-grad forward leaves FSDP2's last unit unsharded, other objects.
    optimizers = default_adamw(lr=1e-3, implementation="foreach").build(model_parts=[model])
    experts = model.layers["0"].moe.routed_experts.inner_experts.w1_EFD
    tokens = TOKENS % whole.config.vocab_size
    wm = wrapkit.adapt(model)
    got, want = wm.full_state_dict(rank0_only=False), whole.state_dict()
    saved = os.path.join(out, "ep")
    wm.save_pretrained(saved)
    dist.barrier()
    files = hub_files(saved)
    adapter = type(titan_layout(whole).to_hub.__self__)(whole.config, None)
    hub = adapter.to_hf(dict(want))
    buffers = {n for n, _ in whole.named_buffers()}
    hub_params = adapter.to_hf({k: v for k, v in want.items() if k not in buffers})
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=2**20) for n, t in b.named_tensors()}
    with torch.no_grad():
        forward = float((wm(tokens) - whole(tokens)).abs().max())
    obs: dict[str, Any] = {
        "local_experts": experts.to_local().shape[0], "forward": forward,
        "full_state_dict": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
        "files": sorted(files) == sorted(hub) and all(torch.equal(files[k], hub[k]) for k in hub),
        "stream": sorted(streamed) == sorted(hub_params) and all(torch.equal(streamed[k], hub_params[k])
                                                                  for k in hub_params)}
    # A reference split the same way (passed in: the experts' own mesh is no record a copy could follow).
    ref = wrapkit.prepare_reference(wm, built(3))
    wm.copy_to(ref)
    back = ref.full_state_dict(rank0_only=False)
    obs["reference"] = all(torch.equal(back[k], want[k]) for k in want)
    # A Hub directory torchtitan's to_hf wrote, loaded: each rank its experts.
    other = qwen3(True, seed=7)
    obs.update(loads_theirs(wm, adapter, other, os.path.join(out, "ep_theirs")))
    with torch.no_grad():
        obs["loaded_forward"] = float((wm(tokens) - other(tokens)).abs().max())
    # A step, and torchtitan's checkpoint of it resumed on DDP and on expert parallelism again.
    model(tokens).float().pow(2).mean().backward()
    optimizers.step()
    optimizers.zero_grad()
    ckpt = os.path.join(out, "ep_checkpoint", "step-1")
    dcp.save({**ModelWrapper([model]).state_dict(), "optimizer": optimizers}, checkpoint_id=ckpt)
    theirs_moments = moments(model, optimizers.optimizers[0])
    stepped = wm.full_state_dict(rank0_only=False)
    target = wrapkit.adapt(DistributedDataParallel(qwen3(True, seed=1)))
    opt = torch.optim.AdamW(target.module.parameters(), lr=0.5)
    target.load_state(ckpt, opt)
    got = target.full_state_dict(rank0_only=False)
    obs["resumed_ddp"] = all(torch.equal(got[k], v) for k, v in stepped.items())
    obs["moments_ddp"] = same_moments(theirs_moments, moments(target.module.module, opt))
    again = built(2)
    opt = torch.optim.AdamW(again.parameters(), lr=0.5)
    wrapkit.adapt(again).load_state(ckpt, opt)
    got = wrapkit.adapt(again).full_state_dict(rank0_only=False)
    obs["resumed_ep"] = all(torch.equal(got[k], v) for k, v in stepped.items())
    obs["moments_ep"] = same_moments(theirs_moments, moments(again, opt))
    return obs


def pipelined(make: Any, seed: int) -> tuple[Any, Any]:
    """``make(seed)`` cut into two stages by torchtitan's ``pipeline_llm`` (its 1F1B schedule, a stage per rank,
    each parallelized by the family's own function: FSDP2 over one rank, as without data parallelism): the
    schedule and this rank's ``PipelineStage``."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    parallel_dims.device_type = "cpu"  # torchtitan's meshes go on "cuda" where it finds no accelerator
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    dims.build_mesh()
    model = make(seed)
    family = type(model).__module__.split(".")[2]
    fn = {"llama3": parallelize_llama, "qwen3": parallelize_qwen3}[family]
    schedule, _, _, _ = pipeline_llm(
        model, parallel_dims=dims, training=TrainingConfig(local_batch_size=2),
        parallelism=ParallelismConfig(pipeline_parallel_degree=2), compile_config=CompileConfig(), ac_config=None,
        dump_folder="", device=torch.device("cpu"), model_config=model.config, parallelize_fn=fn, loss_fn=_loss)
    return schedule, schedule._stage


def _loss(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, None]:
    return nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten()), None


def _step(schedule: Any, stage: Any, tokens: torch.Tensor) -> float | None:
    """One forward and backward of the schedule; the last stage's mean loss."""
    losses: list[torch.Tensor] = []
    labels = tokens.roll(-1, 1)
    if stage.is_first:
        schedule.step(tokens, target=labels if stage.is_last else None, losses=losses)
    else:
        schedule.step(target=labels, losses=losses)
    return float(torch.stack(losses).detach().mean()) if losses else None


def resumed_into(target: Any, module: nn.Module, directory: str, weights: dict[str, torch.Tensor],
                 theirs: dict[str, dict[str, torch.Tensor]]) -> bool:
    """``load_state`` of ``directory`` into ``target`` (``module``: its model, whose parameters a fresh AdamW
    steps): every weight of ``weights`` and every moment of ``theirs`` (by name) restored exactly."""
    opt = torch.optim.AdamW(module.parameters(), lr=0.5)
    target.load_state(directory, opt)
    got, mine = target.full_state_dict(rank0_only=False), moments(module, opt)
    return all(torch.equal(got[k], v) for k, v in weights.items()) and len(theirs) > 0 and all(
        torch.equal(mine[k][s], v) for k, m in theirs.items() for s, v in m.items())


def pipeline_checks(make: Any, out: str) -> dict[str, Any]:
    """One torchtitan model cut into stages by torchtitan's pipeline: every operation against the unsharded model
    and torchtitan's to_hf; a step of its schedule and its checkpoint, resumed on DDP and on stages again."""
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer import default_adamw

    from wrapkit.formats.torchtitan import titan_layout

    whole = make(0)
    tokens = TOKENS % whole.config.vocab_size
    schedule, stage = pipelined(make, 0)
    wm = wrapkit.adapt(stage)
    want = whole.state_dict()
    adapter = type(titan_layout(whole).to_hub.__self__)(whole.config, None)
    hub = adapter.to_hf(dict(want))
    obs: dict[str, Any] = {"stack": list(wm.stack)}
    got = wm.full_state_dict(rank0_only=False)
    obs["full_state_dict"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    saved = os.path.join(out, "saved")
    wm.save_pretrained(saved)
    dist.barrier()
    files = hub_files(saved)
    obs["files"] = sorted(files) == sorted(hub) and all(torch.equal(files[k], hub[k]) for k in hub)
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=2**20) for n, t in b.named_tensors()}
    obs["stream"] = len(streamed) > 0 and all(torch.equal(t, hub[n]) for n, t in streamed.items())
    with torch.no_grad(), wm.gathered() as full:
        obs["gathered"] = float((full(tokens) - whole(tokens)).abs().max())
    # A reference: rebuilt whole it would not be cut as the policy is; cut and passed in, it takes the policy's.
    try:
        wrapkit.prepare_reference(wm)
        obs["copy_refused"] = ""
    except wrapkit.WrapkitError as exc:
        obs["copy_refused"] = str(exc)
    ref = wrapkit.prepare_reference(wm, pipelined(make, 3)[1])
    wm.copy_to(ref)
    back = ref.full_state_dict(rank0_only=False)
    obs["reference"] = all(torch.equal(back[k], want[k]) for k in want)
    # A Hub directory torchtitan's to_hf wrote, loaded: each stage its own layers, and the schedule's loss is then
    # the loss of the model the directory came from.
    other = make(7)
    obs.update(loads_theirs(wm, adapter, other, os.path.join(out, "theirs")))
    loss = _step(schedule, stage, tokens)
    with torch.no_grad():
        other_loss = float(_loss(other(tokens), tokens.roll(-1, 1))[0])
        first_loss = float(_loss(whole(tokens), tokens.roll(-1, 1))[0])
    obs["loss"] = None if loss is None else abs(loss - other_loss)
    obs["loss_apart"] = abs(first_loss - other_loss)  # what a load that wrote nothing would leave
    # A step of torchtitan's pipeline and its checkpoint (every stage its own part), resumed on DDP (weights and
    # each stage's Adam moments) and on stages again.
    optimizers = default_adamw(lr=1e-3, implementation="foreach").build(model_parts=[stage.submod])
    optimizers.step()
    optimizers.zero_grad()
    ckpt = os.path.join(out, "checkpoint", "step-1")
    dcp.save({**ModelWrapper([stage.submod]).state_dict(), "optimizer": optimizers}, checkpoint_id=ckpt)
    trained_state = wm.full_state_dict(rank0_only=False)
    theirs_moments = moments(stage.submod, optimizers.optimizers[0])
    ddp = wrapkit.adapt(DistributedDataParallel(make(1)))
    obs["resumed_ddp"] = resumed_into(ddp, ddp.module.module, ckpt, trained_state, theirs_moments)
    _, again = pipelined(make, 2)
    obs["resumed_stages"] = resumed_into(wrapkit.adapt(again), again.submod, ckpt, trained_state, theirs_moments)
    # wrapkit's own save_state of the stages (torchtitan's optimizer container), resumed on DDP and on stages.
    own = os.path.join(out, "own_state")
    wm.save_state(own, optimizers)
    ddp = wrapkit.adapt(DistributedDataParallel(make(4)))
    obs["own_ddp"] = resumed_into(ddp, ddp.module.module, own, trained_state, theirs_moments)
    _, again = pipelined(make, 5)
    obs["own_stages"] = resumed_into(wrapkit.adapt(again), again.submod, own, trained_state, theirs_moments)
    return obs


def main(out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from wrapkit.adapters.dtensor.sharding import unit_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    obs: dict[str, Any] = {}
    ckpt = os.path.join(out, "checkpoint", "step-1")
    model, optimizers = trained(build(False, seed=0), ckpt)
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
    # The fused attention projection: its state-dict hooks save wqkv as wq/wk/wv. wrapkit's exports are the
    # module's own state dict (the hooks run on the gathered wqkv), and its loads take that state dict.
    fused_dir = os.path.join(out, "fused", "step-1")
    fused, fused_optimizers = trained(build(True, seed=0), fused_dir)
    theirs = moments(fused, fused_optimizers.optimizers[0])
    fused_wm = wrapkit.adapt(fused)
    whole = build(True, seed=2)
    fsd = fused_wm.full_state_dict(rank0_only=False)
    obs["fused_keys"] = sorted(fsd) == sorted(whole.state_dict())
    obs["fused_named"] = sorted(n for n, _ in fused_wm.named_full_parameters()) == sorted(
        n for n in whole.state_dict() if "freqs" not in n)
    whole.load_state_dict(fsd)  # torch's own load, through the hooks
    with torch.no_grad():
        obs["fused_logits"] = float((whole(TOKENS) - fused_wm(TOKENS)).abs().max())
    again = wrapkit.adapt(DistributedDataParallel(build(True, seed=3)))
    obs["fused_load"] = list(again.load_full_state_dict(fsd))
    back = again.full_state_dict(rank0_only=False)
    obs["fused_round_trip"] = all(torch.equal(back[k], fsd[k]) for k in fsd)
    saved = os.path.join(out, "fused.safetensors")
    fused_wm.save(saved)
    from_file = wrapkit.adapt(build(True, seed=4))
    from_file.load(saved)
    with torch.no_grad():
        obs["fused_file_logits"] = float((from_file(TOKENS) - fused_wm(TOKENS)).abs().max())
    # torchtitan's own checkpoint of the fused model: its weights in the hooks' names (wq/wk/wv), its optimizer
    # state in the parameters' (wqkv). load_state builds wqkv through the model's own load hooks.
    other = wrapkit.adapt(DistributedDataParallel(build(True, seed=1)))
    opt = torch.optim.AdamW(other.module.parameters(), lr=0.5)
    other.load_state(fused_dir, opt)
    got = other.full_state_dict(rank0_only=False)
    obs["fused_resumed"] = all(torch.equal(got[k], v) for k, v in fsd.items())
    mine = moments(other.module.module, opt)
    obs["fused_moments"] = same_moments(theirs, mine)
    obs["fused_moment_keys"] = sorted(k for k in mine if "wqkv" in k)
    # torchtitan's tied Qwen3 and Qwen3-MoE: their checkpoints resumed on DDP, their references.
    for name, make in [("qwen3", partial(qwen3, False)), ("qwen3_moe", partial(qwen3, True))]:
        obs[f"resume_{name}"] = resumes(lambda seed, make=make: make(seed=seed), os.path.join(out, name, "step-1"))
    # The Hub's layout of torchtitan's Llama3 (fused), tied Qwen3 and Qwen3-MoE, found from torchtitan's adapters.
    for name, make in [("llama3", partial(build, True)), ("qwen3", partial(qwen3, False)),
                       ("qwen3_moe", partial(qwen3, True)), ("deepseek_v3", deepseek_v3)]:
        where = os.path.join(out, "hub", name)
        os.makedirs(where, exist_ok=True)
        obs[f"hub_{name}"] = hub_checks(lambda seed, make=make: make(seed=seed), where)
    obs["expert_parallel"] = expert_parallel(out)
    # torchtitan refuses a tied model in a pipeline: Qwen3 untied.
    def untied(config: Any) -> None:
        config.enable_weight_tying = False

    for name, make in [("llama3", partial(build, True)), ("qwen3", partial(qwen3, False, configure=untied)),
                       ("qwen3_moe", partial(qwen3, True, configure=untied))]:
        where = os.path.join(out, "pipeline", name)
        os.makedirs(where, exist_ok=True)
        obs[f"pipeline_{name}"] = pipeline_checks(lambda seed, make=make: make(seed=seed), where)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(obs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
