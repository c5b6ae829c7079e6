from __future__ import annotations

from typing import Any

from tests.harness import scenarios


def test_fsdp2_dtensor_counts_and_unwrap(group: Any) -> None:
    for obs in group.run(scenarios.quirks, "fsdp2", timeout=120):
        assert obs["param_type"] == "DTensor"
        # A DTensor reports its global shape: the count needs no collective.
        assert obs["local_numel"] == obs["global_numel"]
        # FSDP2 wraps nothing: the model itself is returned.
        assert obs["unwrap_is_module"] is True
