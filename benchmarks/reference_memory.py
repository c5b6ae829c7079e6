"""Per-rank parameter bytes of ``prepare_reference(policy)`` vs the full model, for ZeRO-3,
FSDP1 and FSDP2 policies on two gloo ranks. Goal: <= 0.55 (the floor is 1/world = 0.5).

Measured with ``wm.resident_parameter_bytes()`` right after preparation and again after a
forward pass (what stays resident while the policy trains next to it).
"""

from __future__ import annotations

from typing import Any

import torch
from _common import print_rows, row, two_ranks

NAME = "reference_memory"
GOAL = 0.55


def _measure(spec: str) -> dict[str, int]:
    import wrapkit
    from wrapkit.cli._models import build, tiny_llama

    def model() -> torch.nn.Module:
        return tiny_llama(0, layers=8, hidden=256, vocab=1024)

    full = sum(p.numel() * p.element_size() for p in model().parameters())
    policy = wrapkit.adapt(build(spec, model=model()))
    ref = wrapkit.prepare_reference(policy)
    at_rest = ref.resident_parameter_bytes()
    with torch.no_grad():
        ref(torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0)))
    return {"full": full, "at_rest": at_rest, "after_forward": ref.resident_parameter_bytes()}


def run(quick: bool = False) -> list[dict[str, Any]]:
    rows = []
    with two_ranks() as group:
        for spec in ("zero3", "fsdp", "fsdp2"):
            per_rank = group.run(_measure, spec, timeout=600)
            full = per_rank[0]["full"]
            for when in ("at_rest", "after_forward"):
                worst = max(r[when] for r in per_rank)
                rows.append(row(f"{spec} ({when.replace('_', ' ')})", worst, full, GOAL, unit="B",
                                note="largest rank / full model"))
    return rows


if __name__ == "__main__":
    print_rows("reference parameter bytes per rank vs the full model", run())
