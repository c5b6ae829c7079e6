"""Per-rank parameter bytes of ``prepare_reference(policy)`` vs the full model, for ZeRO-3,
FSDP1 and FSDP2 policies on two gloo ranks. Goal: <= 0.55 (the floor is 1/world = 0.5).

Measured with ``wm.resident_parameter_bytes()`` right after preparation and again after a
forward pass (what stays resident while the policy trains next to it). For FSDP2 also the peak
during a forward, against a reference sharded with one ``fully_shard`` on the root, as TRL's
``prepare_fsdp`` does.
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


def _peak_during_forward(per_block: bool) -> dict[str, int]:
    """Largest per-rank parameter bytes seen at any submodule boundary of one forward of an FSDP2
    reference: sharded per block (wrapkit) or with one ``fully_shard`` on the root (TRL's own
    ``prepare_fsdp``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import wrapkit
    from wrapkit.adapters.dtensor.sharding import shard_fsdp2
    from wrapkit.cli._models import tiny_llama

    model = tiny_llama(0, layers=8, hidden=256, vocab=1024).eval()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if per_block:
        ref = wrapkit.adapt(shard_fsdp2(model, mesh))
    else:
        ref = wrapkit.adapt(fully_shard(model, mesh=mesh))
    peak = [0]

    def note(*_: Any) -> None:
        peak[0] = max(peak[0], ref.resident_parameter_bytes())

    for m in model.modules():
        m.register_forward_pre_hook(note)
        m.register_forward_hook(note)
    with torch.no_grad():
        model(torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0)))
    return {"full": full, "peak": peak[0]}


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
        ours = max(r["peak"] for r in group.run(_peak_during_forward, True, timeout=600))
        root_only = max(r["peak"] for r in group.run(_peak_during_forward, False, timeout=600))
        rows.append(row("fsdp2 (peak in a forward)", ours, root_only, 1.0, unit="B",
                        note="per-block reference / TRL-style root-only fully_shard"))
    return rows


if __name__ == "__main__":
    print_rows("reference parameter bytes per rank vs the full model", run())
