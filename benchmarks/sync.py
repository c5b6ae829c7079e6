"""Weight sync: ``policy.copy_to(ref, alpha)`` vs copying the same tensors locally, on ZeRO-3 and
FSDP2, two gloo ranks, at three model sizes. Goal: ratio <= 1.2.

The baseline is the least any sync can do on a rank: the EMA update of the parameter slices
this rank holds, done directly on those tensors with the same fused in-place operations
``copy_to`` uses (the per-tensor EMA a trainer writes by hand is timed too, for scale). A
TR-DPO style soft update runs every few steps, so a sync that gathers the model each time
costs real training time. After the first
call the validated pairing is cached: a sync then makes one all-reduce (the check that every
rank made the same call), none with ``WRAPKIT_CHECK_CALLS=0`` (the "unchecked" rows).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from _common import barrier_timed, interleaved, median, print_rows, row, two_ranks

NAME = "sync"
GOAL = 1.2
ALPHA = 0.1
SIZES = {"S": 256, "M": 512, "L": 1024}  # hidden size of an 8-layer Llama (vocab 1024)


def _times(backend: str, hidden: int, reps: int,
           checked: bool) -> tuple[list[float], list[float], float, list[float]]:

    import wrapkit
    from wrapkit._agree import CHECK_ENV
    from wrapkit._registry import as_adapter
    from wrapkit.cli._models import build, tiny_llama

    policy = wrapkit.adapt(build(backend, model=tiny_llama(0, layers=8, hidden=hidden, vocab=1024)))
    # The usual target: a frozen reference prepared the way the policy is sharded.
    ref = wrapkit.prepare_reference(policy, tiny_llama(1, layers=8, hidden=hidden, vocab=1024))
    # The primitives are the adapter's, below the public handle.
    shards = as_adapter(ref).weights.local_shards()
    sources = as_adapter(policy).weights.local_shards()
    assert shards is not None and sources is not None
    pairs = [(shards[k][0], sources[k][0]) for k in shards]
    megabytes = sum(s.numel() * s.element_size() for _, s in pairs) / 2**20

    dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]

    def local_copy() -> None:
        # The least an EMA of these shards costs: two fused in-place passes over all of them.
        with torch.no_grad():
            torch._foreach_mul_(dsts, 1 - ALPHA)
            torch._foreach_add_(dsts, srcs, alpha=ALPHA)

    def per_tensor() -> None:
        # The EMA as a trainer writes it by hand, one tensor at a time (shown for scale).
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(dst.float() * (1 - ALPHA) + src.float() * ALPHA)

    def sync() -> None:
        policy.copy_to(ref, alpha=ALPHA)

    if not checked:
        os.environ[CHECK_ENV] = "0"
    try:
        for _ in range(2):
            barrier_timed(sync)
            barrier_timed(local_copy)
        through, base = interleaved(lambda: barrier_timed(sync), lambda: barrier_timed(local_copy), reps)
        by_hand = [barrier_timed(per_tensor) for _ in range(max(3, reps // 3))]
        collectives = _collectives(sync)
    finally:
        os.environ.pop(CHECK_ENV, None)
    return through, base, megabytes, by_hand, collectives


def _collectives(call: Any, calls: int = 4) -> dict[str, float]:
    """The collectives one ``call`` makes, by kind, per call: gloo's own events in torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    counts: dict[str, float] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            kind = event.name.removeprefix("gloo:")
            counts[kind] = counts.get(kind, 0) + 1 / calls
    return counts


def _latency(reps: int) -> list[float]:
    """One small all-reduce over the two ranks: the least an agreement between them costs."""
    import torch.distributed as dist

    flags = torch.zeros(3)
    return [barrier_timed(lambda: dist.all_reduce(flags)) for _ in range(reps)]


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 5 if quick else 30
    rows = []
    with two_ranks() as group:
        # What bounds a checked sync of a small model: its one all-reduce, beside the copy it guards.
        floor = median(group.run(_latency, reps, timeout=120)[0])
        for backend in ("zero3", "fsdp2"):
            for size, hidden in SIZES.items():
                for checked in (True, False):
                    if quick and size != "S":
                        continue
                    through, base, mb, by_hand, counts = group.run(_times, backend, hidden, reps, checked,
                                                                   timeout=600)[0]
                    case = f"{backend} {size}" + ("" if checked else " unchecked")
                    made = ", ".join(f"{n:g} {kind}" for kind, n in sorted(counts.items())) or "none"
                    note = (f"EMA alpha={ALPHA}, {mb:.0f} MB of shards per rank, median of {reps}; "
                            f"per-tensor EMA by hand {median(by_hand) * 1e3:.2f} ms; collectives per call: {made}"
                            + (f" (one all-reduce alone: {floor * 1e3:.2f} ms)" if counts else ""))
                    rows.append(row(case, median(through), median(base), GOAL, note=note, samples=(through, base)))
    return rows


if __name__ == "__main__":
    print_rows("copy_to vs a local copy of the same shards", run())
