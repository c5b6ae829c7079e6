"""Helpers shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from wrapkit.cli._workers import WorkerGroup

PRELOAD = ("transformers", "peft", "deepspeed")


def two_ranks() -> WorkerGroup:
    """A two-rank gloo group; the caller closes it."""
    return WorkerGroup(world_size=2, backend="gloo", preload=PRELOAD)


def barrier_timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes on this rank, started together on every rank (a barrier first)."""
    import time

    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def interleaved(a: Callable[[], float], b: Callable[[], float], reps: int) -> tuple[list[float], list[float]]:
    """``reps`` timings of each of ``a`` and ``b`` (each returns its own time), run in pairs whose
    order alternates (``a`` first on odd pairs), so drift and noise hit both alike."""
    times_a: list[float] = []
    times_b: list[float] = []
    for i in range(reps):
        order = ((a, times_a), (b, times_b)) if i % 2 else ((b, times_b), (a, times_a))
        for fn, out in order:
            out.append(fn())
    return times_a, times_b


def row(case: str, wrapkit_value: float, baseline: float, goal: float, *, better: str = "lower",
        unit: str = "s", note: str = "") -> dict[str, Any]:
    # "lower": wrapkit's cost relative to the baseline's; "higher": wrapkit's speed-up over it.
    if better == "higher":
        ratio = baseline / wrapkit_value if wrapkit_value else float("inf")
    else:
        ratio = wrapkit_value / baseline if baseline else float("inf")
    return {"case": case, "wrapkit": wrapkit_value, "baseline": baseline, "unit": unit, "ratio": ratio,
            "goal": goal, "better": better, "note": note}


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    for r in rows:
        sign = "<=" if r["better"] == "lower" else ">="
        print(f"  {r['case']:<24} wrapkit {r['wrapkit']:.4g} {r['unit']}  baseline {r['baseline']:.4g} {r['unit']}  "
              f"ratio {r['ratio']:.3f}  (goal {sign} {r['goal']:g}) {r['note']}")
