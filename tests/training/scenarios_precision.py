"""Scenarios for mixed precision and multi-node topologies, run on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import build

PROMPT = (torch.arange(12).reshape(2, 6) * 7) % 128
NEW_TOKENS = 6


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _own_greedy(wm: Any) -> torch.Tensor:
    """Greedy decoding through the backend's own forward (collective on sharded backends)."""
    seq = PROMPT.clone()
    for _ in range(NEW_TOKENS):
        nxt = _logits(wm(input_ids=seq))[:, -1].float().argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def dtypes(spec: str, precision: str, eval_first: bool) -> dict[str, Any]:
    """The dtype each way of running computes in, and greedy tokens inside and outside generation()."""
    model = build(spec, precision=precision)
    wm = wrapkit.adapt(model)
    obs: dict[str, Any] = {}
    if eval_first:
        # What evaluation and reference log-prob passes do between training steps.
        model.eval()
        with torch.no_grad():
            wm(input_ids=PROMPT)
        model.train()
    model.eval()
    with torch.no_grad():
        own = _logits(wm(input_ids=PROMPT))
        obs["own_dtype"] = str(own.dtype)
        own_tokens = _own_greedy(wm)
    model.train()
    try:
        with wm.generation() as m:
            inside = _logits(m(input_ids=PROMPT))
            obs["generation_dtype"] = str(inside.dtype)
            obs["generation_diff"] = float((inside.float() - own.float()).abs().max())
            out = m.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
            obs["same_tokens"] = bool(torch.equal(out, own_tokens))
        with wm.gathered() as m, torch.no_grad():
            obs["gathered_dtype"] = str(_logits(m(input_ids=PROMPT)).dtype)
    except Exception as exc:  # reported, so every rank's failure is seen side by side
        obs["error"] = f"{type(exc).__name__}: {exc}"[:300]
    obs["training_after"] = model.training
    ref = wrapkit.prepare_reference(wm, None)
    with torch.no_grad():
        obs["reference_dtype"] = str(_logits(ref(input_ids=PROMPT)).dtype)
    return obs


def generation_first(spec: str, precision: str, topology: str) -> dict[str, Any]:
    """generation() on a model that has not run a forward yet (FSDP's lazy init not done)."""
    model = build(spec, precision=precision, topology=topology)
    wm = wrapkit.adapt(model)
    with wm.generation() as m:
        inside = _logits(m(input_ids=PROMPT))
    model.eval()
    with torch.no_grad():
        own = _logits(wm(input_ids=PROMPT))
    model.train()
    return {"dtypes": (str(own.dtype), str(inside.dtype)), "diff": float((inside.float() - own.float()).abs().max())}


def fsdp1_input_casts() -> dict[str, Any]:
    """FSDP1 MixedPrecision given inputs_embeds in fp32: its root casts them to param_dtype, and so
    does generation()."""
    model = build("fsdp", precision="bf16")
    wm = wrapkit.adapt(model)
    embeds = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        own = _logits(wm(inputs_embeds=embeds))
    model.train()
    with wm.generation() as m:
        inside = _logits(m(inputs_embeds=embeds))
    return {"dtypes": (str(own.dtype), str(inside.dtype)), "diff": float((inside.float() - own.float()).abs().max())}


def _last(wm: Any, name: str) -> float:
    out = 0.0
    for n, t in wm.named_full_parameters():  # collective: consumed fully on every rank
        if n == name:
            out = float(t.flatten()[-1])
    return out


def topology_writes(spec: str, topology: str) -> dict[str, Any]:
    """gathered(modifier_rank=r) on a multi-node layout: the writer's values reach every shard
    and every replica; a reference prepared from it runs like the policy."""
    wm = wrapkit.adapt(build(spec, topology=topology))
    writer = wm.world_size - 1
    obs: dict[str, Any] = {"world": wm.world_size, "rank": wm.rank, "global_rank": dist.get_rank()}
    obs["group_line"] = next(line for line in wm.describe().splitlines() if line.startswith("group:"))
    with wm.gathered(modifier_rank=writer) as m:
        # The group stays the same inside: the module holds full copies, not the shards.
        obs["inside"] = (wm.world_size, wm.rank)
        if wm.rank == writer:
            with torch.no_grad():
                # A different value on each replica's writer: one of them must win everywhere.
                m.lm_head.weight.fill_(10.0 + dist.get_rank())
    obs["after"] = _last(wm, "lm_head.weight")
    ref = wrapkit.prepare_reference(wm, None)
    obs["ref_world"] = ref.world_size
    with torch.no_grad():
        obs["ref_diff"] = float((_logits(ref(input_ids=PROMPT)) - _logits(wm(input_ids=PROMPT))).abs().max())
    return obs



def topology_operations(spec: str, topology: str, path: str) -> dict[str, Any]:
    """save/load, copy_to, place and generation on a multi-node layout, as on one group."""
    import os

    wm = wrapkit.adapt(build(spec, topology=topology))
    obs: dict[str, Any] = {}
    plain = build("plain")
    with torch.no_grad():
        want = plain.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    with wm.generation() as m:
        out = m.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    obs["generation_same"] = bool(torch.equal(out, want))
    # save, then change the weights, then load: the saved values come back on every rank.
    before = {n: t.clone() for n, t in wm.named_full_parameters()}
    try:
        wm.save(os.path.join(path + ".missing", "model.safetensors"))
    except wrapkit.StateDictError as exc:
        obs["bad_save"] = str(exc)
    wm.save(path)
    obs["file_written"] = os.path.isfile(path)
    with wm.gathered(modifier_rank=0) as m, torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    wm.load(path)
    after = {n: t.clone() for n, t in wm.named_full_parameters()}
    obs["load_diff"] = max(float((after[n] - before[n]).abs().max()) for n in before)
    # copy_to a reference prepared from another seed: the policy's values, everywhere.
    ref = wrapkit.prepare_reference(wm, build("plain", seed=1))
    wm.copy_to(ref, alpha=0.5)
    other = {n: p.detach() for n, p in build("plain", seed=1).named_parameters()}
    got = {n: t.clone() for n, t in ref.named_full_parameters()}
    obs["ema_diff"] = max(float((got[n] - (0.5 * before[n] + 0.5 * other[n])).abs().max()) for n in before)
    # place: off to the CPU and back, values unchanged.
    wm.place("cpu")
    wm.place()
    back = {n: t.clone() for n, t in wm.named_full_parameters()}
    obs["place_diff"] = max(float((back[n] - before[n]).abs().max()) for n in before)
    return obs



def export_masters(spec: str, path: str) -> dict[str, Any]:
    """A 16-bit DeepSpeed engine after a step: full_state_dict/save export the optimizer's fp32
    masters, and load puts them back exactly."""
    from deepspeed.utils import safe_get_full_fp32_param

    wm = wrapkit.adapt(build(spec, precision="bf16"))
    engine = wm.module
    tokens = torch.arange(16).reshape(2, 8) % 128
    engine.backward(engine(tokens, labels=tokens).loss)
    engine.step()
    sd = wm.full_state_dict(rank0_only=False)
    obs: dict[str, Any] = {"dtypes": sorted({str(v.dtype) for v in sd.values()})}
    # The masters hold more than bf16 can: otherwise this test could not tell them from upcast weights.
    obs["beyond_bf16"] = any(bool((v != v.bfloat16().float()).any()) for v in sd.values())
    masters: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        m = safe_get_full_fp32_param(p)
        if m is not None:
            masters[name] = m.detach().clone()
    unfused = getattr(engine.optimizer, "fp32_groups", None)
    if not masters and unfused is not None:  # ZeRO-0: one fp32 parameter per bf16 one
        lows = [p for group in engine.optimizer.fp16_groups for p in group]
        highs = [p for group in unfused for p in group]
        names = {id(p): n for n, p in engine.module.named_parameters()}
        masters = {names[id(lo)]: hi.detach().clone() for lo, hi in zip(lows, highs, strict=True)}
    obs["masters"] = len(masters)
    obs["export_is_masters"] = all(torch.equal(sd[n], m.view(sd[n].shape)) for n, m in masters.items())
    wm.save(path)
    with wm.gathered(modifier_rank=0) as m, torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    wm.load(path)
    again = wm.full_state_dict(rank0_only=False)
    obs["round_trip"] = all(torch.equal(again[k], sd[k]) for k in sd)
    return obs


def fsdp2_output_dtype(output_dtype: str | None) -> dict[str, Any]:
    """FSDP2 computing in bf16 with outputs cast back (``output_dtype``), and inputs_embeds given in fp32
    (cast to param_dtype by FSDP2's forward): generation() casts as FSDP2's own forward does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from wrapkit.cli._models import tiny_llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The root alone casts its outputs back (on the blocks, the next one would get fp32 inputs).
    out_dtype = {"fp32": torch.float32, None: None}[output_dtype]
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=out_dtype)
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=blocks)
    fully_shard(model, mesh=mesh, mp_policy=root)
    wm = wrapkit.adapt(model)
    embeds = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        own = _logits(wm(input_ids=PROMPT))
        own_embeds = _logits(wm(inputs_embeds=embeds))
    model.train()
    with wm.generation() as m:
        inside = _logits(m(input_ids=PROMPT))
        inside_embeds = _logits(m(inputs_embeds=embeds))
    return {"own_dtype": str(own.dtype), "generation_dtype": str(inside.dtype),
            "diff": float((inside.float() - own.float()).abs().max()),
            "embeds_diff": float((inside_embeds.float() - own_embeds.float()).abs().max())}
