"""`wrapkit bench` end to end on the fast benchmarks (the ratios themselves are not asserted:
speed goals live in the benchmarks, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import wrapkit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_bench_runs_and_writes_json_and_plot(tmp_path: Path) -> None:
    report, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    out = subprocess.run(
        [sys.executable, "-m", "wrapkit", "bench", "unwrap", "overhead", "--quick", "--json", str(report),
         "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(report.read_text())["results"]
    assert {r["benchmark"] for r in rows} == {"unwrap", "overhead"}
    backends = {"ddp", "fsdp", "fsdp2", "zero2", "zero3"}
    assert {r["case"] for r in rows if r["benchmark"] == "overhead"} == backends | {
        f"{b} (call cost bound)" for b in backends
    }
    for r in rows:
        assert r["wrapkit"] > 0 and r["baseline"] > 0 and r["ratio"] > 0
    # Timed rows carry the ratio's standard error; the bound computed from one measurement has none.
    timed = [r for r in rows if "call cost bound" not in r["case"]]
    assert all(r["stderr"] is not None and r["stderr"] >= 0 for r in timed), timed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ratio +/- s.e." in out.stdout
    # Third-party warnings stay out of the report (torch warns once per deprecated call in the workers).
    assert "Warning: " not in out.stdout + out.stderr, out.stdout + out.stderr


def test_a_miss_within_the_noise_is_not_called_a_miss() -> None:
    from wrapkit.cli.bench import verdict

    base = {"ratio": 1.10, "goal": 1.05, "better": "lower"}
    assert verdict({**base, "stderr": None}) == "NO"
    assert verdict({**base, "stderr": 0.04}) == "noise"  # 0.05 over, 2 s.e. = 0.08
    assert verdict({**base, "stderr": 0.02}) == "NO"
    assert verdict({**base, "ratio": 1.0, "stderr": 0.5}) == "yes"
    faster = {"ratio": 8.0, "goal": 10.0, "better": "higher"}
    assert verdict({**faster, "stderr": 1.5}) == "noise" and verdict({**faster, "stderr": 0.5}) == "NO"


def test_bench_rejects_unknown_names() -> None:
    out = subprocess.run([sys.executable, "-m", "wrapkit", "bench", "nope"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "available:" in out.stderr


def test_bench_without_benchmarks_says_where_they_are(tmp_path: Path) -> None:
    """As from an installed wheel: no benchmarks/ folder. A message saying what to do, no traceback."""
    out = subprocess.run([sys.executable, "-m", "wrapkit", "bench", "--dir", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "source distribution" in out.stderr and "--dir" in out.stderr


def test_version_and_bench_help_list_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    from wrapkit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"wrapkit {wrapkit.__version__}"
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    names = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("[!_]*.py"))
    assert names and all(f"\n  {n} " in out for n in names), out
    assert max(len(line) for line in out.splitlines()) <= 100, out
