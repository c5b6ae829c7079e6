"""Soak: hundreds of generation / step / copy_to / offload cycles leave nothing behind.

The default suite runs ``WRAPKIT_SOAK_CYCLES`` cycles (30); ``wrapkit bench soak`` runs 300."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.sync import scenarios_soak

CYCLES = int(os.environ.get("WRAPKIT_SOAK_CYCLES", "30"))
WARMUP = min(10, CYCLES // 3)


@pytest.mark.long
@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3"])
def test_soak(group: Any, spec: str) -> None:
    for rank, obs in enumerate(group.run(scenarios_soak.soak, spec, CYCLES, WARMUP, timeout=30 + 6 * CYCLES)):
        where = f"{spec} rank {rank}"
        growth = obs["rss_end"] / obs["rss_warm"]
        assert growth <= 1.02, f"{where}: RSS grew {growth:.3f}x after warm-up ({obs['rss_warm']} -> {obs['rss_end']})"
        assert obs["fds"][0] == obs["fds"][1], f"{where}: file descriptors {obs['fds']}"
        assert obs["structure_same"] and obs["ref_structure_same"], f"{where}: hooks, attributes or parameters changed"
        assert obs["temp_files"] == [], f"{where}: temporary files left: {obs['temp_files']}"
        assert obs["losses"] == obs["control_losses"], f"{where}: losses differ from the control run"
