"""adapters/dtensor/layout.py: DTensors of any Shard/Replicate placement on any mesh, gathered with one
all-gather per sharded mesh dimension, written back and loaded exactly (uneven sizes included)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.parallel import scenarios_dtensor as sd

FLAT = [["S0"], ["S1"], ["R"]]
TWO_D = [["R", "S0"], ["S0", "S1"], ["S0", "S0"], ["S1", "R"], ["S1", "S0"], ["R", "R"]]


@pytest.mark.parametrize("placements", FLAT, ids=lambda p: "-".join(p))
def test_flat_mesh(group: Any, placements: list[str]) -> None:
    for rank, problems in enumerate(group.run(sd.layouts, [2], placements, timeout=60)):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("placements", TWO_D, ids=lambda p: "-".join(p))
def test_two_d_mesh(group4: Any, placements: list[str]) -> None:
    for rank, problems in enumerate(group4.run(sd.layouts, [2, 2], placements, timeout=60)):
        assert problems == [], f"rank {rank}: {problems}"


def test_cast_before_the_gather(group4: Any) -> None:
    for rank, problems in enumerate(group4.run(sd.layouts, [2, 2], ["R", "S0"], "bfloat16", timeout=60)):
        assert problems == [], f"rank {rank}: {problems}"


def test_strided_shards_gathered_with_the_others(group4: Any) -> None:
    for rank, problems in enumerate(group4.run(sd.strided, timeout=60)):
        assert not problems, f"rank {rank}: {problems}"
