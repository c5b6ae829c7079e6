"""``wrapkit.shutdown()`` ends a distributed run with exit code 0 on every rank, with ``atexit`` handlers
run and open files flushed, also after DDP, whose process group outlives ``destroy_process_group()``."""

from __future__ import annotations

from pathlib import Path

import pytest

import wrapkit
from tests.harness._matrix import long
from tests.harness.launch import ROOT, torchrun

SCRIPT = ROOT / "tests" / "cli" / "shutdown_run.py"


@pytest.mark.timeout(120)
# DDP, whose group outlives destroy_process_group(), by default; plain collectives long.
@pytest.mark.parametrize("kind", ["ddp", long("collectives")])
def test_shutdown_exits_cleanly(kind: str, tmp_path: Path) -> None:
    torchrun(SCRIPT, str(tmp_path), kind, timeout=100)  # fails on a non-zero exit of either rank
    for rank in (0, 1):
        assert (tmp_path / f"atexit{rank}.txt").read_text() == "ran\n", f"rank {rank}: atexit handler skipped"
        assert (tmp_path / f"log{rank}.txt").read_text() == "written, never flushed\n", f"rank {rank}: lost"


@pytest.mark.parametrize("code", [-1, 256, True, "0"])
def test_shutdown_refuses_a_bad_exit_code(code: object) -> None:
    with pytest.raises(wrapkit.ArgumentError, match="exit_code"):
        wrapkit.shutdown(code)  # type: ignore[arg-type]
