"""Mixed precision and multi-node layouts: every operation computes in the backend's own
forward dtype, and writes reach every shard and every replica."""

from __future__ import annotations

from typing import Any

import pytest

from tests.training import scenarios_precision as sp

# (spec, precision, an eval forward first): FSDP2 keeps the root unsharded after a no-grad
# forward, which once left generation() with half of the weights in bf16 and half in fp32.
# DeepSpeed's fp16 needs an accelerator: its CPU accelerator refuses it at initialize().
DTYPE_CASES = [
    ("fsdp2", "bf16", True), ("fsdp2", "fp16", False), ("fsdp", "bf16", False), ("fsdp", "fp16", True),
    ("zero0", "bf16", False), ("zero1", "bf16", True), ("zero2", "bf16", False), ("zero3", "bf16", True),
    ("ddp", "bf16", False), ("fsdp2>peft", "bf16", False), ("zero3>peft", "bf16", False), ("fsdp2", "fp32", True),
]


@pytest.mark.parametrize(("spec", "precision", "eval_first"), DTYPE_CASES)
def test_generation_computes_in_the_forward_dtype(group: Any, spec: str, precision: str, eval_first: bool) -> None:
    for rank, obs in enumerate(group.run(sp.dtypes, spec, precision, eval_first, timeout=180)):
        assert "error" not in obs, f"{spec} {precision} rank {rank}: {obs['error']}"
        want = f"torch.{ {'bf16': 'bfloat16', 'fp16': 'float16', 'fp32': 'float32'}[precision] }"
        assert obs["own_dtype"] == want, obs
        assert obs["generation_dtype"] == obs["gathered_dtype"] == want, f"{spec} {precision}: {obs}"
        assert obs["reference_dtype"] == want, f"{spec} {precision}: the reference computes in another dtype"
        # The same casts as the backend's own forward: the same logits, and the same greedy tokens.
        assert obs["generation_diff"] == 0.0, f"{spec} {precision}: {obs}"
        assert obs["same_tokens"], f"{spec} {precision}: generate() inside generation() decodes other tokens"
        assert obs["training_after"] is True


TOPOLOGY_CASES = [
    ("fsdp2", "hsdp"), ("fsdp2", "submesh"), ("fsdp", "hsdp"), ("fsdp", "hybrid-groups"), ("fsdp", "hybrid-zero2"),
    ("ddp", "subgroup"), ("zero2", "subgroup"), ("zero3", "subgroup"), ("zero3", "flat"),
]
# The writer is the last rank of the model's group; global rank g writes 10 + g.
# One model replicated over two shard groups: the first replica's writer (global 1) wins everywhere.
# Two independent models, one per half of the ranks: each keeps its own writer's value (global 1 and 3).
# One model over all four ranks: global 3 writes.
_REPLICATED, _INDEPENDENT = [11.0] * 4, [11.0, 11.0, 13.0, 13.0]
EXPECTED_AFTER = {"hsdp": _REPLICATED, "hybrid-groups": _REPLICATED, "hybrid-zero2": _REPLICATED,
                  "submesh": _INDEPENDENT,
                  "subgroup": _INDEPENDENT, "flat": [13.0] * 4}


@pytest.mark.parametrize(("spec", "topology"), TOPOLOGY_CASES)
def test_writes_reach_every_shard_and_replica(group4: Any, spec: str, topology: str) -> None:
    results = group4.run(sp.topology_writes, spec, topology, timeout=180)
    # world_size and rank are the group the parameters are sharded (or replicated) over,
    # and stay so inside gathered(), where the module holds full copies.
    world = 4 if topology == "flat" else 2
    ranks = [0, 1, 2, 3] if topology == "flat" else [0, 1, 0, 1]
    assert [r["world"] for r in results] == [world] * 4 and [r["rank"] for r in results] == ranks
    assert [tuple(r["inside"]) for r in results] == [(world, r) for r in ranks], "the group changed inside gathered()"
    lines = [r["group_line"] for r in results]
    if EXPECTED_AFTER[topology] == _REPLICATED:
        assert ["copy 0 of 2" in line for line in lines] == [True, True, False, False], lines
        assert ["copy 1 of 2" in line for line in lines] == [False, False, True, True], lines
    else:
        assert not any("replicated" in line for line in lines), lines
    assert [r["after"] for r in results] == EXPECTED_AFTER[topology], results
    for r in results:
        # Sharded policies get references sharded over the same group; replicated ones a bare module.
        assert r["ref_world"] == (1 if spec in ("ddp", "zero2") else world)
        assert r["ref_diff"] < 1e-5, f"{spec} {topology}: the reference computes differently: {r}"


@pytest.mark.parametrize(("spec", "topology"), TOPOLOGY_CASES)
def test_operations_on_multi_node_layouts(group4: Any, tmp_path: Any, spec: str, topology: str) -> None:
    results = group4.run(sp.topology_operations, spec, topology, str(tmp_path / "model.safetensors"), timeout=240)
    for rank, obs in enumerate(results):
        assert obs["generation_same"], f"{spec} {topology} rank {rank}: generate() decodes other tokens"
        assert obs["file_written"]
        # Checked by the one writer (the first replica's rank 0), raised by every rank of every replica.
        assert "does not exist" in obs.get("bad_save", ""), f"{spec} {topology} rank {rank}: {obs}"
        assert obs["load_diff"] == 0.0, f"{spec} {topology} rank {rank}: {obs}"
        assert obs["ema_diff"] < 1e-6, f"{spec} {topology} rank {rank}: {obs}"
        assert obs["place_diff"] == 0.0, f"{spec} {topology} rank {rank}: {obs}"


@pytest.mark.parametrize("spec", ["zero0", "zero1", "zero2", "zero3"])
def test_export_is_the_optimizers_fp32_masters(group: Any, tmp_path: Any, spec: str) -> None:
    for rank, obs in enumerate(group.run(sp.export_masters, spec, str(tmp_path / "m.safetensors"), timeout=180)):
        assert obs["dtypes"] == ["torch.float32"], f"{spec} rank {rank}: {obs}"
        assert obs["beyond_bf16"] and obs["masters"] > 0, obs
        assert obs["export_is_masters"], f"{spec} rank {rank}: the export is not the optimizer's fp32 masters"
        assert obs["round_trip"], f"{spec} rank {rank}: load did not put the masters back exactly"


@pytest.mark.parametrize("output_dtype", ["fp32", None])
def test_fsdp2_output_dtype_and_input_casts(group: Any, output_dtype: str | None) -> None:
    for obs in group.run(sp.fsdp2_output_dtype, output_dtype, timeout=120):
        assert obs["own_dtype"] == obs["generation_dtype"] == ("torch.float32" if output_dtype else "torch.bfloat16")
        assert obs["diff"] == 0.0 and obs["embeds_diff"] == 0.0, obs


def test_fsdp1_root_input_casts(group: Any) -> None:
    for obs in group.run(sp.fsdp1_input_casts, timeout=120):
        assert obs["dtypes"] == ("torch.bfloat16", "torch.bfloat16") and obs["diff"] == 0.0, obs


@pytest.mark.parametrize(("spec", "precision", "topology"), [
    ("fsdp", "bf16", "flat"), ("fsdp", "bf16", "hsdp"), ("fsdp2", "bf16", "hsdp"), ("zero3", "bf16", "flat"),
])
def test_generation_before_any_forward(group4: Any, spec: str, precision: str, topology: str) -> None:
    for obs in group4.run(sp.generation_first, spec, precision, topology, timeout=120):
        assert obs["dtypes"] == ("torch.bfloat16", "torch.bfloat16") and obs["diff"] == 0.0, obs
