"""The main job: `wrapkit doctor` end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXPECTED_ROWS = ["plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]


def test_doctor_all_backends_pass(tmp_path: Path) -> None:
    report = tmp_path / "doctor.json"
    out = subprocess.run(
        [sys.executable, "-m", "wrapkit", "doctor", "--json", str(report)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(report.read_text())
    assert list(data["results"]) == EXPECTED_ROWS
    for backend, cells in data["results"].items():
        ops = {k: v for k, v in cells.items() if not k.startswith("_")}
        assert {"adapt", "config", "unwrap", "num_parameters", "forward"} <= set(ops), backend
        assert all(cell[0] for cell in ops.values()), (backend, ops)
    table = out.stdout
    for row in EXPECTED_ROWS:
        assert any(line.startswith(row + " ") for line in table.splitlines()), row
    assert "all passed" in table and "torch 2." in table


def test_doctor_subset_and_exit_code(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wrapkit", "doctor", "--backends", "plain,nonsense"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 1
    assert "nonsense" in out.stdout and "FAIL" in out.stdout
