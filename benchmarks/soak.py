"""Soak: 300 cycles of generation(), a training step, copy_to(ref, alpha=0.1) and an offload to the
CPU and back, on FSDP1, FSDP2 and ZeRO-3, two gloo ranks. Goal: the process's resident memory
after the last cycle <= 1.02x what it was after the warm-up (the test, tests/sync/test_soak.py, also
checks hooks, attributes, parameter objects, file descriptors, temporary files and the losses
against a control run; it runs 30 cycles)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _common import print_rows, row, two_ranks

NAME = "soak"
GOAL = 1.02
CYCLES, WARMUP = 300, 20

# The scenario lives with the tests (tests/sync/scenarios_soak.py), beside this folder in a checkout.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def run(quick: bool = False) -> list[dict[str, Any]]:
    from tests.sync.scenarios_soak import soak

    cycles, warmup = (30, 10) if quick else (CYCLES, WARMUP)
    rows = []
    with two_ranks() as group:
        for backend in ("fsdp", "fsdp2", "zero3"):
            results = group.run(soak, backend, cycles, warmup, timeout=60 + 3 * cycles)
            worst = max(results, key=lambda o: o["rss_end"] / o["rss_warm"])
            same = all(o["losses"] == o["control_losses"] and o["structure_same"] and o["ref_structure_same"]
                       and o["fds"][0] == o["fds"][1] and not o["temp_files"] for o in results)
            note = (f"{cycles} cycles in {worst['seconds']:.0f} s ({1e3 * worst['seconds'] / cycles:.0f} ms each), "
                    f"RSS {worst['rss_warm'] / 2**20:.0f} -> {worst['rss_end'] / 2**20:.0f} MiB (max "
                    f"{worst['rss_max'] / 2**20:.0f}); losses, hooks, fds and files "
                    + ("unchanged" if same else "CHANGED"))
            rows.append(row(backend, worst["rss_end"] / 2**20, worst["rss_warm"] / 2**20, GOAL, unit="MiB",
                            note=note))
            if not same:  # growth is not the only failure: then the goal is not met whatever the memory
                rows[-1]["ratio"] = float("inf")
    return rows


if __name__ == "__main__":
    print_rows("resident memory after the soak vs after its warm-up", run())
