"""Overhead of going through ``wm``: a training step (forward, backward, step) called
as ``wm(...)`` vs the raw wrapper, per backend, two gloo ranks. Goal: ratio <= 1.01.

The two paths run on the same model, interleaved step by step (order alternating),
so drift and noise hit both alike; the ratio is the geometric mean of the per-pair ratios.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from _common import interleaved, median, print_rows, relative_stderr, row, two_ranks

NAME = "overhead"
GOAL = 1.01
BACKENDS = ("ddp", "fsdp", "fsdp2", "zero2", "zero3")
BLOCK = 5


def _steps(backend: str, reps: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama

    # A small model is the hardest case: any fixed cost of the adapter weighs most.
    model = build(backend, model=tiny_llama(layers=2, hidden=64, vocab=256))
    wm = wrapkit.adapt(model)
    is_ds = wm.backend == "deepspeed"
    opt = None if is_ds else torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    def step(call: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = call(x, labels=x).loss
        if is_ds:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            assert opt is not None
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):
        step(model)
        step(wm)
    # Blocks of steps, alternating which path goes first: single steps on two ranks sharing
    # two cores jitter by several percent, blocks average that out.
    return interleaved(lambda: sum(step(model) for _ in range(BLOCK)) / BLOCK,
                       lambda: sum(step(wm) for _ in range(BLOCK)) / BLOCK, reps)


def _dispatch_cost(number: int) -> float:
    """Seconds the adapter adds to one call, measured on a module that does nothing."""
    import timeit

    import wrapkit

    class Nothing(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x

    module = Nothing()
    wm = wrapkit.adapt(module)
    raw = min(timeit.repeat(lambda: module(None), number=number, repeat=5)) / number
    through = min(timeit.repeat(lambda: wm(None), number=number, repeat=5)) / number
    return max(0.0, through - raw)


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 2 if quick else 60
    rows = []
    steps: dict[str, float] = {}
    with two_ranks() as group:
        for backend in BACKENDS:
            raw, through = group.run(_steps, backend, reps, timeout=600)[0]
            r = row(backend, median(through), median(raw), GOAL,
                    note=f"geometric mean over {reps} pairs of {BLOCK}-step blocks")
            # The mean of log-ratios: each pair ran back to back, so slow phases of the machine cancel.
            r["ratio"] = math.exp(sum(math.log(t / b) for t, b in zip(through, raw, strict=True)) / reps)
            rel = relative_stderr(through, raw)
            r["stderr"] = None if rel is None else r["ratio"] * rel
            rows.append(r)
            steps[backend] = median(raw)
    # Timing noise of whole steps on a shared machine is a few percent; the adapter's own
    # cost is what it adds to one call, measured directly and set against the step time.
    extra = _dispatch_cost(20_000 if quick else 500_000)
    for backend, step_time in steps.items():
        rows.append(row(f"{backend} (call cost bound)", step_time + extra, step_time, GOAL,
                        note=f"{extra * 1e9:.0f} ns added per call"))
    return rows


if __name__ == "__main__":
    print_rows("training-step time through wm vs the raw wrapper", run())
