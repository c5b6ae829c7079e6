"""vLLM's trainer-side weight transfer fed by ``wrapkit.integrations.vllm.weight_source``, through the send and
receive of ``tests/engines/vllm_standin.py`` (vLLM 0.28-0.33's dense, packed transfer, over gloo)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import scenarios_engines as se
from tests.harness import _matrix as matrix
from wrapkit.cli._workers import free_port
from wrapkit.integrations.engines._vllm_source import wire_order

# Gathered (FSDP2, ZeRO-3 on a tied model), whole (DDP in bf16, LoRA merged on the way), experts split per
# expert (Qwen3-MoE on FSDP1), a bf16 wire with fp32 norms kept, both of vLLM's interfaces, a vision-language
# model and a reward model.
CASES = [{"spec": "fsdp2", "family": "llama"},
         {"spec": "zero3", "family": "qwen2-tied", "interface": "0.28", "wire": "bfloat16"},
         {"spec": "ddp", "family": "llama", "precision": "bf16", "merge": True},
         {"spec": "fsdp", "family": "qwen3-moe", "wire": "bfloat16", "keep": True},
         {"spec": "fsdp2", "family": "qwen2-vl"}, {"spec": "zero3", "family": "llama-reward"}]
BUFFER = 24 * 1024  # several chunks per update


# Four ranks standing in for two nodes: HSDP's replicas, and ZeRO-3 in sub-groups, each rank but the first
# driving the gathers only.
FOUR_RANK_CASES = [{"spec": "fsdp2", "family": "llama", "topology": "hsdp"},
                   {"spec": "zero3", "family": "qwen3-moe", "topology": "subgroup", "wire": "bfloat16"}]


def _check(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    syncs = per_rank[0][matrix.key(case)]
    for step, sync in enumerate(syncs):
        others = [obs[matrix.key(case)][step] for obs in per_rank[1:]]
        assert sync["error"] is None, sync["error"]
        assert sync["declared"] == sync["owned"] > 0, sync
        assert all(o["declared"] == sync["declared"] and o["owned"] == 0 for o in others), others
        assert sync["chunks"] > 1 and sync["loaded"] == sync["declared"], sync
        assert sync["compared"] > 0 and sync["wrong"] == [], sync["wrong"][:5]
    if case.get("keep"):
        assert syncs[0]["dtypes"] == ["torch.bfloat16", "torch.float32"], syncs[0]["dtypes"]


@matrix.cases(CASES, [])
def test_vllm_source_gives_the_engine_the_model(group: Any, case: dict[str, Any]) -> None:
    _check(case, group.run(se.sync_through_vllm_source, [case], [free_port()], BUFFER, timeout=240))


@matrix.cases(FOUR_RANK_CASES, [])
def test_vllm_source_on_four_rank_layouts(group4: Any, case: dict[str, Any]) -> None:
    _check(case, group4.run(se.sync_through_vllm_source, [case], [free_port()], BUFFER, timeout=240))


@pytest.mark.parametrize("split", ["pipeline", "experts"])
def test_vllm_source_funnels_stages_and_expert_shares_to_the_sender(group: Any, tmp_path: Path, split: str) -> None:
    [sync, other] = group.run(se.vllm_source_from_split_model, str(tmp_path), split, free_port(), BUFFER, timeout=240)
    assert sync["error"] is None, sync["error"]
    assert sync["declared"] == other["declared"] == sync["owned"] > 0 and other["owned"] == 0
    assert sync["loaded"] == sync["declared"] and sync["compared"] > 0 and sync["wrong"] == [], sync["wrong"][:5]


def test_a_sender_that_stops_fails_every_rank(group: Any) -> None:
    [mine, theirs] = group.run(se.vllm_sender_that_stops, timeout=120)
    assert mine[0] == "RuntimeError: broadcast failed after 3 tensors", mine
    # The sender had taken a fourth tensor when its broadcast failed: at most three were sent.
    assert theirs[0].startswith("EngineError") and "after taking 4 of the" in theirs[0], theirs
    assert "at most 3 reached the engine" in theirs[0], theirs
    assert mine[1] == theirs[1] and mine[1].startswith("then "), (mine, theirs)


def _chunks(order: list[tuple[str, tuple[int, ...], torch.dtype]], buffer: int) -> list[list[int]]:
    """vLLM's chunk cut: each chunk closes right after the tensor that takes it past ``buffer`` bytes."""
    out: list[list[int]] = [[]]
    total = 0
    for _, shape, dtype in order:
        out[-1].append(math.prod(shape) * dtype.itemsize)
        total += out[-1][-1]
        if total > buffer:
            out.append([])
            total = 0
    return [c for c in out if c]


def _aligned(order: list[tuple[str, tuple[int, ...], torch.dtype]], buffer: int) -> bool:
    sizes = iter(order)
    for chunk in _chunks(order, buffer):
        at = 0
        for size in chunk:
            _, _, dtype = next(sizes)
            if at % dtype.itemsize:
                return False
            at += size
    return True


def test_wire_order_starts_every_tensor_aligned_however_chunks_are_cut() -> None:
    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int8]
    stream = [(f"t{i}", (rng.randint(1, 9), rng.randint(1, 5)), rng.choice(dtypes)) for i in range(40)]
    total = sum(math.prod(s) * d.itemsize for _, s, d in stream)
    order = wire_order(stream)
    assert sorted(e[0] for e in order) == sorted(e[0] for e in stream)  # every tensor, once
    assert all(_aligned(order, b) for b in range(1, total + 2))
    assert not all(_aligned(stream, b) for b in range(1, total + 2))  # the stream's own order is not
    even = [e for e in stream if math.prod(e[1]) * e[2].itemsize % 8 == 0]
    assert [e[0] for e in wire_order(even)] == [e[0] for e in even]  # nothing moves where nothing must


def test_weight_source_refuses_bad_arguments() -> None:
    from wrapkit import ArgumentError
    from wrapkit.integrations.vllm import weight_source

    with pytest.raises(ArgumentError, match="bucket_bytes"):
        weight_source(object(), bucket_bytes=0)
    with pytest.raises(ArgumentError, match="src_rank"):
        weight_source(object(), src_rank=3)
