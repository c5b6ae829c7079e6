"""Loading checkpoints whose tensors are float8 (``scenarios_dtypes``): exact on every backend, read by
every rank or broadcast from one; a dtype torch cannot hold is refused before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.exchange import scenarios_dtypes as sd

SPECS = ["plain", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]


def check(obs: dict[str, Any], where: str) -> None:
    for key, value in obs.items():
        if "/f4/" in key:
            refused, changed = value
            assert refused.startswith("StateDictError"), f"{where} {key}: {refused}"
            assert not changed, f"{where} {key}: the refused load wrote {changed}"
        else:
            assert value == [], f"{where} {key}: loaded values differ from the file's on {value}"


def test_fp8_checkpoints_on_every_backend(group: Any, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    for rank, obs in enumerate(group.run(sd.fp8_loads, SPECS, str(tmp_path), timeout=300)):
        check(obs, f"rank {rank}")


def test_fp8_checkpoint_at_world_size_one(tmp_path: Path) -> None:
    check(sd.fp8_loads(["plain", "dp"], str(tmp_path)), "one process")
