"""Megatron-Core models on gloo ranks (``tests/test_megatron.py``): every export against the same weights built at
tensor-parallel size 1, and the Hub layout against transformers' own model built from the exported files."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.megatron_cpu import build


def _whole_names(style: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors at tensor- and pipeline-parallel size 1, built on this rank alone."""
    model = build(style, 1, 1, dtype)
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def logits_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    n = tokens.shape[1]
    positions = torch.arange(n).expand_as(tokens)
    masked = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()  # Megatron's mask: True is left out
    with torch.no_grad():
        return model(tokens, positions, masked)  # type: ignore[no-any-return]


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
    out["stream_hub"] = (sorted(streamed) == sorted(k for k in hub_sd if not (hub.config.tie_word_embeddings
                                                                              and k == "lm_head.weight")),
                         max((streamed[k] - hub_sd[k]).abs().max().item() for k in streamed))
    # A load of the Hub files, into weights scrambled first, gives every rank's slices back (a tied head's copy on
    # the last stage included).
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result = wm.load(directory)
    out["load"] = (list(result.missing_keys), list(result.unexpected_keys),
                   max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True)))
    # And a file in Megatron's own names (save()), which needs no Hub layout.
    path = os.path.join(tmp, f"own-{style}-{tp}-{pp}-{dtype_name}.safetensors")
    wm.save(path)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)
    result = wm.load(path)
    restored = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True))
    out["load_own"] = (list(result.missing_keys), list(result.unexpected_keys), restored)
    dist.barrier()
    return out


def copies(tmp: str) -> dict[str, Any]:
    """``copy_to`` between Megatron models split differently (tensor parallel into stages and back), exact."""
    tp = wrapkit.adapt(build("llama", 2, 1, seed=0))
    expected = tp.full_state_dict(rank0_only=False)
    staged = wrapkit.adapt(build("llama", 1, 2, seed=1))
    tp.copy_to(staged)
    there = staged.full_state_dict(rank0_only=False)
    back = wrapkit.adapt(build("llama", 2, 1, seed=2))
    staged.copy_to(back)
    again = back.full_state_dict(rank0_only=False)
    return {"into_stages": max((there[k] - v).abs().max().item() for k, v in expected.items()),
            "back": max((again[k] - v).abs().max().item() for k, v in expected.items())}


def refusals(tmp: str) -> dict[str, str]:
    """What a Megatron model refuses, each with its typed error: the whole model inside one module, a frozen copy,
    a Hub layout for a GPT-2-style config, several chunks per rank."""
    from tests.megatron_cpu import STYLES

    out: dict[str, str] = {}

    def said(name: str, call: Any) -> None:
        try:
            call()
            out[name] = "no error"
        except wrapkit.WrapkitError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    wm = wrapkit.adapt(build("llama", 2, 1))
    said("gathered", lambda: wm.gathered().__enter__())
    said("reference", lambda: wrapkit.prepare_reference(wm))
    said("chunks", lambda: wrapkit.adapt([build("llama", 1, 1), build("llama", 1, 1)]))
    STYLES["gpt"] = dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                         add_bias_linear=True, add_qkv_bias=True, num_query_groups=4, position="learned_absolute",
                         tied=True)
    try:
        gpt = wrapkit.adapt(build("gpt", 2, 1))
    finally:
        del STYLES["gpt"]
    said("gpt_save_pretrained", lambda: gpt.save_pretrained(os.path.join(tmp, "gpt")))
    full = gpt.full_state_dict(rank0_only=False)  # its own names, which need no Hub layout
    out["gpt_names"] = ",".join(sorted(full)[:3])
    out["gpt_dir"] = str(os.path.exists(os.path.join(tmp, "gpt")))
    return out
