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

