from __future__ import annotations

from typing import Any

from tests.harness import scenarios


def test_fsdp1_counts_and_sharding(group: Any) -> None:
    for obs in group.run(scenarios.fsdp1_variants, timeout=120):
        assert obs["flat"] == obs["full"]  # use_orig_params=False: sizes read off the FlatParameter
        assert obs["flat_sharded"] is True
        assert obs["frozen_trainable"] == obs["full"] - obs["embed"]  # per-parameter flags kept
        assert obs["noshard_sharded"] is False and obs["noshard_count"] == obs["full"]


def test_fsdp1_local_shards_are_smaller_than_the_model(group: Any) -> None:
    for obs in group.run(scenarios.quirks, "fsdp", timeout=120):
        assert 0 < obs["local_numel"] < obs["global_numel"]
