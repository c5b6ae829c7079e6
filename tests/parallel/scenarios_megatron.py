"""Megatron-Core models on gloo ranks (``tests/parallel/test_megatron.py``): every export against the same weights
built at tensor-parallel size 1, and the Hub layout against transformers' own model built from the exported files."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.exchange.scenarios_families import _bytes_read
from tests.parallel.megatron_cpu import build


def _whole_names(style: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors at tensor- and pipeline-parallel size 1, built on this rank alone."""
    model = build(style, 1, 1, dtype)
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def logits_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    n = tokens.shape[1]
    positions = torch.arange(n).expand_as(tokens)
    masked = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()  # Megatron's mask: True is left out
    with torch.no_grad():
        # Cloned: Megatron may hand out a view of a buffer it reuses.
        return model(tokens, positions, masked).clone()  # type: ignore[no-any-return]


def wrapped(model: torch.nn.Module, wrap: str) -> Any:
    """``model`` as Megatron's training loop holds it: in its DDP (over Float16Module in 16 bits), or as the
    one-element list of chunks its ``get_model`` returns."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config: Any = model.config
    if wrap == "ddp":
        inner = Float16Module(config, model) if config.bf16 else model
        return DistributedDataParallel(config, DistributedDataParallelConfig(), inner)
    if wrap == "chunks":
        return [model]
    return model


def exports(tmp: str, style: str, tp: int, pp: int, dtype_name: str, wrap: str = "none") -> dict[str, Any]:
    """Every export of the split model against the unsplit one, and its Hub files against transformers."""
    dtype = getattr(torch, dtype_name)
    expected = _whole_names(style, dtype)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want_logits = logits_of(build(style, 1, 1, dtype), tokens)
    model = build(style, tp, pp, dtype)
    wm = wrapkit.adapt(wrapped(model, wrap))
    out: dict[str, Any] = {"style": style, "backend": wm.backend, "stack": wm.stack, "sharded": wm.is_sharded,
                           "world": (wm.world_size, wm.rank), "dp": (wm.data_parallel_size, wm.data_parallel_rank),
                           "count": (wm.num_parameters(), sum(v.numel() for v in expected.values())),
                           "describe": wm.describe()}
    full = wm.full_state_dict(rank0_only=False)
    out["names"] = (sorted(full) == sorted(expected), sorted(set(full) ^ set(expected))[:4])
    out["full_diff"] = max((full[k] - expected[k]).abs().max().item() for k in expected if k in full)
    named = dict(wm.named_full_parameters())
    out["named_equal"] = all(torch.equal(named[k], full[k]) for k in full)
    if style == "gpt":  # no Hub model: Megatron's own names only
        dist.barrier()
        return out
    directory = os.path.join(tmp, f"hub-{style}-{tp}-{pp}-{dtype_name}")
    wm.save_pretrained(directory, max_shard_size="20KB")
    from transformers import AutoModelForCausalLM

    hub = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    out["hub_class"] = type(hub).__name__
    with torch.no_grad():
        got = hub(tokens).logits
    out["hub_logits_diff"] = (got.float() - want_logits.float()).abs().max().item()
    out["hub_logits_scale"] = want_logits.float().abs().max().item()
    streamed = {}
    for bucket in wm.stream_full_parameters(bucket_bytes=1 << 14):
        for name, t in bucket.named_tensors():
            streamed[name] = t.clone()
    hub_sd = hub.state_dict()
    # In Megatron's own names: one all-gather per bucket where the model is split over tensor-parallel ranks alone.
    runtime = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=1 << 14, layout="runtime")
               for n, t in b.named_tensors()}
    out["stream_runtime"] = sorted(runtime) == sorted(full) and all(torch.equal(runtime[k], full[k]) for k in full)
    out["stream_hub"] = (sorted(streamed) == sorted(k for k in hub_sd if not (hub.config.tie_word_embeddings
                                                                              and k == "lm_head.weight")),
                         max((streamed[k] - hub_sd[k]).abs().max().item() for k in streamed))
    # A load of the Hub files, into weights scrambled first, gives every rank's slices back (a tied head's copy on
    # the last stage included).
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with _bytes_read() as read:
        result = wm.load(directory)
    out["read_fraction"] = read[0] / read[1]
    out["load"] = (list(result.missing_keys), list(result.unexpected_keys),
                   max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True)))
    # And a file in Megatron's own names (save()), which needs no Hub layout.
    path = os.path.join(tmp, f"own-{style}-{tp}-{pp}-{dtype_name}.safetensors")
    wm.save(path)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)
    with _bytes_read() as read:
        result = wm.load(path)
    out["read_fraction_own"] = read[0] / read[1]
    restored = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True))
    out["load_own"] = (list(result.missing_keys), list(result.unexpected_keys), restored)
    dist.barrier()
    return out


def copies(tmp: str) -> dict[str, Any]:
    """``copy_to`` between Megatron models split differently (tensor parallel into stages and back), exact; then
    ``place``, ``sleep`` and ``wake`` keep every value."""
    tp = wrapkit.adapt(build("llama", 2, 1, seed=0))
    expected = tp.full_state_dict(rank0_only=False)
    staged = wrapkit.adapt(build("llama", 1, 2, seed=1))
    tp.copy_to(staged)
    there = staged.full_state_dict(rank0_only=False)
    back = wrapkit.adapt(build("llama", 2, 1, seed=2))
    staged.copy_to(back)
    again = back.full_state_dict(rank0_only=False)
    # Placed, put to sleep with an optimizer that has stepped, and woken: the same values, every tensor home.
    optimizer = torch.optim.AdamW(back.unwrap().parameters(), lr=0.0)
    for p in back.unwrap().parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    back.place()
    report = back.sleep(optimizer)
    back.wake()
    woke = back.full_state_dict(rank0_only=False)
    return {"into_stages": max((there[k] - v).abs().max().item() for k, v in expected.items()),
            "back": max((again[k] - v).abs().max().item() for k, v in expected.items()),
            "slept": (report.state_bytes > 0, all(torch.equal(woke[k], again[k]) for k in again))}


def refusals(tmp: str) -> dict[str, str]:
    """What a Megatron model refuses, each with its typed error: a frozen copy, a Hub layout for a GPT-2-style
    config (so no whole model to gather either), several chunks per rank."""
    out: dict[str, str] = {}

    def said(name: str, call: Any) -> None:
        try:
            call()
            out[name] = "no error"
        except wrapkit.WrapkitError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    wm = wrapkit.adapt(build("llama", 2, 1))
    with contextlib.ExitStack() as stack:
        said("gathered", lambda: stack.enter_context(wm.gathered()))
    said("chunks", lambda: wrapkit.adapt([build("llama", 1, 1), build("llama", 1, 1)]))
    gpt = wrapkit.adapt(build("gpt", 2, 1))
    said("experts", lambda: wrapkit.adapt(_expert_tp_apart()))
    said("gpt_save_pretrained", lambda: gpt.save_pretrained(os.path.join(tmp, "gpt")))
    said("gpt_gathered", lambda: gpt.gathered().__enter__())
    full = gpt.full_state_dict(rank0_only=False)  # its own names, which need no Hub layout
    out["gpt_names"] = ",".join(sorted(full)[:3])
    out["gpt_dir"] = str(os.path.exists(os.path.join(tmp, "gpt")))
    return out


def generation_ops(tmp: str, style: str, tp: int, pp: int) -> dict[str, Any]:
    """``generation()`` and ``gathered()``: the transformers model of the Hub layout, filled from every rank, with
    Megatron's logits; a change made in it on one rank reaches every rank's slices."""
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want = logits_of(build(style, 1, 1), tokens)
    model = build(style, tp, pp)
    wm = wrapkit.adapt(model)
    out: dict[str, Any] = {}
    with wm.generation() as m:
        out["class"] = type(m).__name__
        out["modes"] = (m.training, torch.is_grad_enabled())
        out["logits"] = (m(tokens).logits - want).abs().max().item()
        out["greedy"] = m.generate(tokens, max_new_tokens=4, do_sample=False, pad_token_id=0).tolist()
    out["restored"] = all(mod.training for mod in model.modules())
    before = wm.full_state_dict(rank0_only=False)
    with wm.gathered(modifier_rank=0) as m:
        if wm.rank == 0:
            with torch.no_grad():
                m.model.norm.weight.add_(1.0)
                m.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    after = wm.full_state_dict(rank0_only=False)
    norm, qkv = "decoder.final_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight"
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    # linear_qkv's rows per query group: its query heads, then its key head, then its value head.
    cfg: Any = model.config
    d, per = cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
    keys = torch.zeros(before[qkv].shape[0], dtype=torch.bool).reshape(cfg.num_query_groups, (per + 2) * d)
    keys[:, per * d:(per + 1) * d] = True
    keys = keys.reshape(-1)
    doubled = (after[qkv][keys] - 2 * before[qkv][keys]).abs().max().item()
    kept = torch.equal(after[qkv][~keys], before[qkv][~keys])
    out["modified"] = (changed, (after[norm] - before[norm] - 1.0).abs().max().item(), doubled, kept)
    return out


def reference(tmp: str, style: str, tp: int, pp: int) -> dict[str, Any]:
    """``prepare_reference``: a frozen copy split the same way, its own storage, with the policy's values and its
    forward (Megatron's own, every rank stepping)."""
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model = build(style, tp, pp)
    wm = wrapkit.adapt(wrapped(model, "ddp"))
    ref = wrapkit.prepare_reference(wm)
    inner = ref.unwrap()
    policy = wm.full_state_dict(rank0_only=False)
    copied = ref.full_state_dict(rank0_only=False)
    shared = {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in inner.parameters()}
    out: dict[str, Any] = {
        "backend": ref.backend, "stack": ref.stack, "frozen": not any(p.requires_grad for p in inner.parameters()),
        "eval": not any(m.training for m in inner.modules()), "shared": len(shared),
        "values": sorted(policy) == sorted(copied) and all(torch.equal(policy[k], copied[k]) for k in policy)}
    if pp == 1:  # one stage: its forward alone gives the logits
        model.eval()
        out["logits"] = (logits_of(inner, tokens) - logits_of(model, tokens)).abs().max().item()
    return out


def mixture_ops(tmp: str, ep: int, tp: int) -> dict[str, Any]:
    """A Qwen3-MoE-style mixture with its experts split over expert-parallel ranks: every export against the model
    built whole, its Hub files against transformers' Qwen3-MoE, and a load of them back into every rank's experts."""
    from transformers import AutoModelForCausalLM

    from tests.parallel.megatron_cpu import build_mixture

    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    whole = build_mixture(1, tp)
    expected = wrapkit.adapt(whole).full_state_dict(rank0_only=False)
    want_logits = logits_of(whole, tokens)
    model = build_mixture(ep, tp)
    wm = wrapkit.adapt(model)
    if wm.rank == 0:  # a summary enters no collective: one rank alone may ask for it
        wm.describe()
    dist.barrier()
    out: dict[str, Any] = {"describe": wm.describe(), "sharded": wm.is_sharded, "backend": wm.backend,
                           "count": (wm.num_parameters(), sum(v.numel() for v in expected.values())),
                           "megatron_logits": (logits_of(model, tokens) - want_logits).abs().max().item()}
    full = wm.full_state_dict(rank0_only=False)
    out["names"] = sorted(set(full) ^ set(expected))[:4]
    out["full_diff"] = max((full[k] - expected[k]).abs().max().item() for k in expected if k in full)
    named = dict(wm.named_full_parameters())
    out["named_equal"] = sorted(named) == sorted(full) and all(torch.equal(named[k], full[k]) for k in full)
    directory = os.path.join(tmp, f"hub-moe-{ep}-{tp}")
    wm.save_pretrained(directory, max_shard_size="20KB")
    hub = AutoModelForCausalLM.from_pretrained(directory)
    out["hub_class"] = type(hub).__name__
    with torch.no_grad():
        out["hub_logits_diff"] = (hub(tokens).logits - want_logits).abs().max().item()
    want_hub = {n: t.clone() for b in wrapkit.adapt(hub).stream_full_parameters() for n, t in b.named_tensors()}
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=1 << 13) for n, t in b.named_tensors()}
    out["stream"] = (sorted(set(streamed) ^ set(want_hub))[:4],
                     max((streamed[k] - want_hub[k]).abs().max().item() for k in want_hub if k in streamed))
    # Other values in, then the Hub files back: every rank's experts restored exactly.
    wm.load_full_state_dict({k: torch.zeros_like(v) for k, v in full.items()})
    wm.load(directory)
    again = wm.full_state_dict(rank0_only=False)
    out["loaded"] = all(torch.equal(again[k], full[k]) for k in full)
    with wm.generation() as m:
        out["generation"] = (type(m).__name__, (m(tokens).logits - want_logits).abs().max().item())
    ref = wrapkit.prepare_reference(wm)
    copied = ref.full_state_dict(rank0_only=False)
    out["reference"] = (ref.is_sharded, sorted(copied) == sorted(full) and all(torch.equal(copied[k], full[k])
                                                                               for k in full))
    return out


def _expert_tp_apart() -> torch.nn.Module:
    """A mixture whose experts are whole on each rank (expert tensor parallel size 1) while its dense layers are
    split over two tensor-parallel ranks."""
    from tests.parallel.megatron_cpu import build_mixture

    return build_mixture(1, tp=2, etp=1)
