"""Every operation from the states a training loop leaves a model in, on every backend
(``scenarios_loop_states``): right after a no-grad forward, right after a training forward,
and between backward and step."""

from __future__ import annotations

from typing import Any

import pytest

from tests import scenarios_loop_states as sl
from wrapkit.cli._models import BACKENDS

FLAT_CASES = [{"spec": b} for b in BACKENDS if b != "dp"] + [
    {"spec": b, "precision": "bf16"} for b in ("fsdp", "fsdp2", "zero3")
]
TOPOLOGY_CASES = [
    {"spec": "fsdp2", "topology": "hsdp"}, {"spec": "fsdp", "topology": "hybrid-groups"},
    {"spec": "zero3", "topology": "subgroup"}, {"spec": "fsdp2", "topology": "submesh", "precision": "bf16"},
]


def check(results: list[dict[str, Any]], cases: list[dict[str, Any]]) -> None:
    for rank, per_case in enumerate(results):
        for case, key in zip(cases, per_case, strict=True):
            obs = per_case[key]
            for state in sl.STATES:
                where = f"rank {rank}, {case}, {state}"
                got = obs[state]
                wrong = {op: r for op, r in got.items() if op in sl.OPS and r != []}
                assert not wrong, f"{where}: {wrong}"
                assert got["step_moved_weights"], f"{where}: the step after the operations changed nothing"
            assert obs["loss_finite"], f"rank {rank}, {case}: the loss is not finite after the steps"


def test_operations_from_loop_states(group: Any) -> None:
    pytest.importorskip("deepspeed")
    check(group.run(sl.loop_state_cases, FLAT_CASES, timeout=400), FLAT_CASES)


def test_operations_from_loop_states_on_multi_node_layouts(group4: Any) -> None:
    check(group4.run(sl.loop_state_cases, TOPOLOGY_CASES, timeout=300), TOPOLOGY_CASES)


def test_dataparallel_from_loop_states() -> None:
    obs = sl.loop_states("dp")
    check([{"dp": obs}], [{"spec": "dp"}])
