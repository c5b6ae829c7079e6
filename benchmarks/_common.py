"""Helpers shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from wrapkit.cli._workers import WorkerGroup

PRELOAD = ("transformers", "peft", "deepspeed")


def two_ranks(preload: Sequence[str] = PRELOAD) -> WorkerGroup:
    """A two-rank gloo group; the caller closes it. Under ``wrapkit bench`` what the workers print
    (third-party warnings and notices) goes to files in ``WRAPKIT_BENCH_LOGS``, not the terminal."""
    return WorkerGroup(world_size=2, backend="gloo", preload=preload, log_dir=os.environ.get("WRAPKIT_BENCH_LOGS"))


def proc_status(field: str) -> int:
    """Bytes of a ``/proc/self/status`` memory field of this process (``VmRSS``, ``VmHWM``). Linux only."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Reset this process's peak resident set (``VmHWM``) to its current one (writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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


def alternated(ways: Sequence[tuple[str, Callable[[], object]]], reps: int) -> dict[str, list[float]]:
    """``reps`` timings of each of ``ways`` (name, function; collective, started together on every rank), in
    rounds whose order reverses every other round, so drift and noise hit each alike."""
    times: dict[str, list[float]] = {key: [] for key, _ in ways}
    for i in range(reps):
        for key, fn in (ways if i % 2 else ways[::-1]):
            times[key].append(barrier_timed(fn))
    return times


def vllm_chunk_sizes(engine: Any, wm: Any, bucket_bytes: int) -> list[int]:
    """The bytes of each packed chunk ``VLLMEngine.sync(wm, bucket_bytes=...)`` broadcasts: vLLM's cut (a chunk
    closed right after the tensor that takes it past the engine's buffer) over the sync's own metadata. A pass of
    the stream on first use: every rank."""
    sizes, size = [], 0
    meta = engine._dense._source_of(wm, bucket_bytes, None, False, None).metadata
    for i, m in enumerate(meta):
        size += m.dtype.itemsize * math.prod(m.shape)
        if size > engine._dense.buffer_bytes or i == len(meta) - 1:
            sizes.append(size)
            size = 0
    return sizes


def relative_stderr(wrapkit_samples: Sequence[float], baseline_samples: Sequence[float], *,
                    paired: bool = True) -> float | None:
    """The standard error of a ratio of the two, relative to the ratio (None: too few samples).

    ``paired``: sample i of each side was measured back to back (``interleaved``), so the error is
    that of the mean log-ratio and drift of the machine cancels within a pair. Otherwise the two
    means' relative errors add in quadrature.
    """
    a = [float(x) for x in wrapkit_samples]
    b = [float(x) for x in baseline_samples]
    if min(len(a), len(b)) < 2 or min(a + b) <= 0:
        return None
    if paired:
        logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
        return statistics.stdev(logs) / math.sqrt(len(logs))
    return math.sqrt(sum(statistics.variance(xs) / (len(xs) * statistics.fmean(xs) ** 2) for xs in (a, b)))


def row(case: str, wrapkit_value: float, baseline: float, goal: float, *, better: str = "lower",
        unit: str = "s", note: str = "",
        samples: tuple[Sequence[float], Sequence[float]] | None = None, paired: bool = True) -> dict[str, Any]:
    """One result. ``samples``: every measurement of each side, for the ratio's standard error
    (``stderr``, in ratio units; None for a value measured once or without noise, such as bytes);
    ``paired``: whether they were measured in back-to-back pairs (``relative_stderr``)."""
    # "lower": wrapkit's cost relative to the baseline's; "higher": wrapkit's speed-up over it.
    if better == "higher":
        ratio = baseline / wrapkit_value if wrapkit_value else float("inf")
    else:
        ratio = wrapkit_value / baseline if baseline else float("inf")
    rel = relative_stderr(*samples, paired=paired) if samples is not None else None
    return {"case": case, "wrapkit": wrapkit_value, "baseline": baseline, "unit": unit, "ratio": ratio,
            "stderr": ratio * rel if rel is not None and math.isfinite(ratio) else None,
            "goal": goal, "better": better, "note": note}


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    for r in rows:
        sign = "<=" if r["better"] == "lower" else ">="
        se = f" +/- {r['stderr']:.3f}" if r.get("stderr") is not None else ""
        print(f"  {r['case']:<24} wrapkit {r['wrapkit']:.4g} {r['unit']}  baseline {r['baseline']:.4g} {r['unit']}  "
              f"ratio {r['ratio']:.3f}{se}  (goal {sign} {r['goal']:g}) {r['note']}")
