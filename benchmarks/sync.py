"""Weight sync: ``policy.copy_to(ref, alpha)`` vs copying the same tensors locally, on ZeRO-3 and
FSDP2, two gloo ranks. Goal: ratio <= 1.5.

The baseline is the least any sync can do on a rank: the EMA update of the parameter
slices this rank holds, done directly on those tensors. A TR-DPO style soft update runs
every few steps, so a sync that gathers the model each time costs real training time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _common import interleaved, median, print_rows, row, two_ranks

NAME = "sync"
GOAL = 1.5
ALPHA = 0.1


def _times(backend: str, reps: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit._registry import as_adapter
    from wrapkit.cli._models import build, tiny_llama

    policy = wrapkit.adapt(build(backend, model=tiny_llama(0, layers=8, hidden=256, vocab=1024)))
    # The usual target: a frozen reference prepared the way the policy is sharded.
    ref = wrapkit.prepare_reference(policy, tiny_llama(1, layers=8, hidden=256, vocab=1024))
    # The primitives are the adapter's, below the public handle.
    shards = as_adapter(ref).local_shards()
    sources = as_adapter(policy).local_shards()
    assert shards is not None and sources is not None
    pairs = [(shards[k][0], sources[k][0]) for k in shards]

    def local_copy() -> None:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(dst.float() * (1 - ALPHA) + src.float() * ALPHA)

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def sync() -> None:
        policy.copy_to(ref, alpha=ALPHA)

    for _ in range(2):
        timed(sync)
        timed(local_copy)
    return interleaved(lambda: timed(sync), lambda: timed(local_copy), reps)


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 5 if quick else 30
    rows = []
    with two_ranks() as group:
        for backend in ("zero3", "fsdp2"):
            through, base = group.run(_times, backend, reps, timeout=600)[0]
            rows.append(row(backend, median(through), median(base), GOAL, note=f"EMA alpha={ALPHA}, median of {reps}"))
    return rows


if __name__ == "__main__":
    print_rows("copy_to vs a local copy of the same shards", run())
