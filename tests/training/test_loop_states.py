"""Every operation from the states a training loop leaves a model in, on every backend
(``scenarios_loop_states``): right after a no-grad forward, right after a training forward,
and between backward and step."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import _matrix as matrix
from tests.training import scenarios_loop_states as sl
from wrapkit.cli._models import BACKENDS

# DataParallel runs in one process (below). transformers' pipeline stages compute the loss on the last stage only and
# leave the backward across stages to a schedule: tests/parallel/test_pipeline.py trains stages with torch's (GPipe).
# Megatron-Core's forward needs CUDA; tests/parallel/test_megatron.py runs it with the CPU stand-ins of
# tests/parallel/megatron_cpu.py.
# The default selection has bf16 through the PEFT cases; the bf16 repeats of the bare backends are long.
# ZeRO-0 and ZeRO-1 (whole parameters, like DDP and ZeRO-2) are long too.
FLAT_CASES = [{"spec": b} for b in BACKENDS if b not in ("dp", "pipeline", "megatron", "zero0", "zero1")] + [
    {"spec": "fsdp2>peft"}, {"spec": "fsdp>peft", "precision": "bf16"}, {"spec": "zero3>peft", "precision": "bf16"}]
LONG_FLAT_CASES = [{"spec": "zero0"}, {"spec": "zero1"}] + [
    {"spec": b, "precision": "bf16"} for b in ("fsdp", "fsdp2", "zero3")]
# Four ranks on two cores cost the most: HSDP and ZeRO-3's sub-groups by default, the other layouts long.
TOPOLOGY_CASES = [{"spec": "fsdp2", "topology": "hsdp"}, {"spec": "zero3", "topology": "subgroup"}]
LONG_TOPOLOGY_CASES = [
    {"spec": "fsdp", "topology": "hybrid-groups"}, {"spec": "fsdp2", "topology": "submesh", "precision": "bf16"},
    {"spec": "fsdp2", "topology": "tp"}, {"spec": "fsdp2", "topology": "hsdp-tp", "precision": "bf16"},
]


def check(per_rank: list[dict[str, Any]], case: dict[str, Any]) -> None:
    for rank, obs in enumerate(per_rank):
        for state in sl.STATES:
            where = f"rank {rank}, {case}, {state}"
            got = obs[state]
            wrong = {op: r for op, r in got.items() if op in sl.OPS + sl.PEFT_OPS and r != []}
            assert any(op in got for op in sl.PEFT_OPS if op not in sl.OPS) == ("peft" in case["spec"]), got
            assert not wrong, f"{where}: {wrong}"
            assert got["step_moved_weights"], f"{where}: the step after the operations changed nothing"
        assert obs["loss_finite"], f"rank {rank}, {case}: the loss is not finite after the steps"
        # Every operation met a zero-element parameter and buffer (once, an FSDP1 stream handed out garbage
        # for the parameter after the empty one).
        empty = sorted([sl.EMPTY_PARAMETER, sl.EMPTY_BUFFER]) if sl.has_empty(case["spec"]) else []
        assert obs["empty_tensors"] == empty, obs["empty_tensors"]


@matrix.cases(FLAT_CASES, LONG_FLAT_CASES)
def test_operations_from_loop_states(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    pytest.importorskip("deepspeed")
    check(matrix.run(request, group, sl.loop_state_cases, timeout=400), case)


@matrix.cases(TOPOLOGY_CASES, LONG_TOPOLOGY_CASES)
def test_operations_from_loop_states_on_multi_node_layouts(request: pytest.FixtureRequest, group4: Any,
                                                           case: dict[str, Any]) -> None:
    check(matrix.run(request, group4, sl.loop_state_cases, timeout=300), case)


def test_dataparallel_from_loop_states() -> None:
    check([sl.loop_states("dp")], {"spec": "dp"})
