"""Overhead of going through ``wm``: a training step (forward, backward, step) called
as ``wm(...)`` vs the raw wrapper, per backend, two gloo ranks. Goal: ratio <= 1.01.

The two paths run on the same model, interleaved step by step (order alternating),
so drift and noise hit both alike; the ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _common import median, print_rows, row, two_ranks

NAME = "overhead"
GOAL = 1.01
BACKENDS = ("ddp", "fsdp", "fsdp2", "zero2", "zero3")


def _steps(backend: str, reps: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama

    model = build(backend, model=tiny_llama(layers=4, hidden=64, vocab=256))
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
    raw: list[float] = []
    through: list[float] = []
    for i in range(reps):
        if i % 2:
            raw.append(step(model))
            through.append(step(wm))
        else:
            through.append(step(wm))
            raw.append(step(model))
    return raw, through


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 6 if quick else 40
    rows = []
    with two_ranks() as group:
        for backend in BACKENDS:
            raw, through = group.run(_steps, backend, reps, timeout=600)[0]
            r = row(backend, median(through), median(raw), GOAL, note=f"median of {reps} step pairs")
            r["ratio"] = median([t / b for t, b in zip(through, raw, strict=True)])
            rows.append(r)
    return rows


if __name__ == "__main__":
    print_rows("training-step time through wm vs the raw wrapper", run())
