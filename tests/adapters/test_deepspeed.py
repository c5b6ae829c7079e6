from __future__ import annotations

from typing import Any

from tests.harness import scenarios


def test_zero3_placeholders_counted_by_full_size(group: Any) -> None:
    for obs in group.run(scenarios.quirks, "zero3", timeout=120):
        assert obs["local_numel"] == 0  # every parameter is an empty placeholder outside a gather
        assert obs["global_numel"] > 0


def test_zero2_parameters_are_whole(group: Any) -> None:
    for obs in group.run(scenarios.quirks, "zero2", timeout=120):
        assert obs["local_numel"] == obs["global_numel"]
