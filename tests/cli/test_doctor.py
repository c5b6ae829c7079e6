"""The main job: `wrapkit doctor` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sync.test_streaming import deepspeed_moves_states
from wrapkit.cli._ops import OPS

EXPECTED_ROWS = ["plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "tp", "pipeline",
                 "megatron"]
# Refused as documented: a frozen copy of a tensor-parallel model, and PEFT on one; PEFT on a Megatron-Core model,
# and its forward on a machine without CUDA.
TP_REFUSED = {("tp", "prepare_reference"), ("tp", "adapters"), ("megatron", "adapters")} | (
    set() if torch.cuda.is_available() else {("megatron", "forward")})


def _doctor_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``wrapkit doctor --json REPORT`` as README's first command runs it (``_doctor``). Where
    ``WRAPKIT_DOCTOR_RUN`` names a folder, the run it holds is the one checked (``doctor.json``, and the command's
    ``stdout``, ``stderr`` and exit code ``rc``): .ci/run runs the main job once, beside its type check, not again
    inside the suite."""
    done = os.environ.get("WRAPKIT_DOCTOR_RUN")
    if not done:
        return _doctor(tmp_path)
    d = Path(done)
    out = subprocess.CompletedProcess(["wrapkit", "doctor"], int((d / "rc").read_text()), (d / "stdout").read_text(),
                                      (d / "stderr").read_text())
    report = d / "doctor.json"
    return out, (json.loads(report.read_text()) if report.exists() else {})


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    return _doctor_run(tmp_path_factory.mktemp("doctor"))


def test_doctor_all_backends_pass(doctor_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    out, data = doctor_run
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(data["results"]) == EXPECTED_ROWS
    for backend, cells in data["results"].items():
        ops = {k: v for k, v in cells.items() if not k.startswith("_")}
        assert {"adapt", "config", "unwrap", "num_parameters", "forward"} <= set(ops), backend
        assert all(cell["ok"] and cell["ms"] >= 0 and cell["error"] == "" for cell in ops.values()), (backend, ops)
    table = out.stdout
    # sleep/wake is refused (typed, nothing moved) only where DeepSpeed cannot move an engine's states:
    # shown as n/a, with the reason below the table.
    refused = {(b, op) for b, cells in data["results"].items() for op, cell in cells.items()
               if not op.startswith("_") and cell.get("refused")}
    assert TP_REFUSED <= refused <= {(b, "sleep/wake") for b in ("zero1", "zero2", "zero3")} | TP_REFUSED, refused
    if deepspeed_moves_states():
        assert refused == TP_REFUSED, refused
    for backend, op in refused:
        why = {"prepare_reference": "cannot build a frozen copy", "adapters": "PEFT", "forward": "needs CUDA"}.get(
            op, "offload_states")
        assert f"{backend}/{op}: " in table and why in data["results"][backend][op]["refused"], table
    # Backends across, operations down, within 100 columns.
    header = next(line for line in table.splitlines() if line.startswith("(ms)"))
    assert header.split()[1:] == EXPECTED_ROWS, header
    for op in ["adapt", *(name for name, _ in OPS)]:
        assert any(line.startswith(op + " ") for line in table.splitlines()), op
    assert max(len(line) for line in table.splitlines()) <= 100, table  # the versions header included
    # DeepSpeed's one-time setup (its op build on a fresh machine) is on a line of its own.
    assert "one-time, before zero0's adapt" in table and data["one_time"]["zero0"]["ok"], table
    assert "all passed" in table and "torch 2." in table
    # Not a terminal: no progress display is left in the output.
    assert "━" not in out.stdout and "/190" not in out.stdout, out.stdout[:2000]
    # Third-party warnings and notices from the workers are counted, not shown.
    assert "Warning" not in out.stdout + out.stderr and "accelerator" not in out.stdout + out.stderr, out.stderr
    assert f"{len(data['worker_output'])} lines of third-party output" in table and data["worker_output"]


def test_readmes_table_of_what_works_where_is_the_doctors(
        doctor_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    """README's table has the doctor's backends and operations, each cell what the doctor's run gave: passed,
    refused as documented (n/a), or refused for want of CUDA (run where there is one, it passes)."""
    _, data = doctor_run
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## What works where")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("| ---")]
    backends = rows[0][1:]
    assert backends == list(data["results"]), backends
    table = {row[0].strip("`"): dict(zip(backends, row[1:], strict=True)) for row in rows[1:]}
    ops = [op for op in data["results"][backends[0]] if not op.startswith("_")]
    assert list(table) == ops, list(table)
    for backend in backends:
        for op in ops:
            cell, got = table[op][backend], data["results"][backend][op]
            refused = got.get("refused", "")
            if cell == "CUDA":
                assert ("needs CUDA" in refused) if not torch.cuda.is_available() else got["ok"], (backend, op)
            else:
                assert cell == ("n/a" if refused else "✓") and got["ok"], (backend, op, cell, got)


def test_a_refused_operation_is_shown_as_not_applicable() -> None:
    from wrapkit.cli.doctor import _format_table

    ok = {"ok": True, "ms": 12.0, "error": "", "traceback": ""}
    rows = {"zero2": {"adapt": ok, "sleep/wake": {**ok, "refused": "needs DeepSpeed 0.17"}},
            "fsdp2": {"adapt": ok, "sleep/wake": {**ok, "ok": False, "error": "AssertionError: x"}}}
    lines = _format_table(rows, ["adapt", "sleep/wake"]).splitlines()
    assert lines[-1].split() == ["sleep/wake", "n/a", "FAIL"] and lines[-2].split() == ["adapt", "12", "12"], lines


def _doctor(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "doctor.json"
    out = subprocess.run([sys.executable, "-m", "wrapkit", "doctor", "--json", str(report), *args],
                         capture_output=True, text=True, timeout=600)
    return out, (json.loads(report.read_text()) if report.exists() else {})


@pytest.mark.long
def test_doctor_bf16(tmp_path: Path) -> None:
    out, data = _doctor(tmp_path, "--dtype", "bf16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dtype bf16" in out.stdout and data["dtype"] == "bf16"
    assert list(data["results"]) == EXPECTED_ROWS
    for backend, cells in data["results"].items():
        assert all(cell["ok"] for k, cell in cells.items() if not k.startswith("_")), (backend, cells)
        assert "generation" in cells and "save/load" in cells


@pytest.mark.long
def test_doctor_four_ranks_hsdp(tmp_path: Path) -> None:
    out, data = _doctor(tmp_path, "--world-size", "4", "--topology", "hsdp", "--backends", "ddp,fsdp,fsdp2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "topology hsdp" in out.stdout and "4 ranks" in out.stdout
    # A backend without the layout is listed as unsupported, with the reason, not failed.
    assert data["results"]["ddp"]["_status"] == "unsupported" and "fsdp" in data["results"]["ddp"]["_why"]
    for backend in ("fsdp", "fsdp2"):
        cells = data["results"][backend]
        assert len(cells) == 1 + len(OPS) and all(cell["ok"] for cell in cells.values()), (backend, cells)


def test_doctor_hsdp_needs_four_ranks(tmp_path: Path) -> None:
    out, _ = _doctor(tmp_path, "--topology", "hsdp")
    assert out.returncode == 2 and "--world-size 4" in out.stdout


@pytest.mark.long
def test_doctor_on_a_chosen_family(tmp_path: Path) -> None:
    """`--model qwen3-moe`: every operation on the MoE (LoRA on its experts in the adapters column), and a
    family the tensor-parallel recipe does not fit shown as unsupported with the reason."""
    out, data = _doctor(tmp_path, "--model", "qwen3-moe", "--backends", "plain,fsdp2,zero3,megatron")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model: transformers qwen3-moe" in out.stdout and data["model"] == "qwen3-moe"
    for backend in ("plain", "fsdp2", "zero3"):
        cells = data["results"][backend]
        assert len(cells) == 1 + len(OPS) and all(c["ok"] and not c.get("refused") for c in cells.values()), cells
    # Megatron-Core's mixture: its experts over the two ranks (expert parallel), every operation passing.
    cells = data["results"]["megatron"]
    refused = {op for op, c in cells.items() if c.get("refused")}
    assert len(cells) == 1 + len(OPS) and all(c["ok"] for c in cells.values()), cells
    assert refused == {op for b, op in TP_REFUSED if b == "megatron"}, refused
    out, _ = _doctor(tmp_path, "--model", "nonsense")
    assert out.returncode == 2 and "qwen3-moe" in out.stdout


@pytest.mark.long
def test_doctor_subset_and_exit_code(tmp_path: Path) -> None:
    """A subset with an unknown backend fails (exit 1) and says which; a family a layout does not fit is shown
    as unsupported with the reason, not failed; -v shows what the workers printed. One run for the three: each
    run starts its own worker processes."""
    out, data = _doctor(tmp_path, "--model", "t5", "--backends", "plain,tp,megatron,nonsense", "-v")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "nonsense" in out.stdout and "FAIL" in out.stdout
    assert all(cell["ok"] for k, cell in data["results"]["plain"].items() if not k.startswith("_")), data["results"]
    for backend in ("tp", "megatron"):
        assert data["results"][backend]["_status"] == "unsupported" and "t5" in data["results"][backend]["_why"]
    # -v shows what the workers printed (DeepSpeed's notices on import, at least), rank by rank.
    assert "output of the worker processes" in out.stdout and "\n  [rank0] " in out.stdout, out.stdout
