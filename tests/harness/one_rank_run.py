"""Launched by test_calls: rank 0 alone calls a collective operation with ``WRAPKIT_ENTRY_TIMEOUT`` set;
it must raise ``DistributedStateError`` naming the call within about that bound, instead of waiting for
the process group's timeout. Rank 1 never calls it. Results go to the JSON file in argv[1]."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import wrapkit


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    wm = wrapkit.adapt(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4)))
    result: dict[str, object] = {}
    if dist.get_rank() == 0:
        t0 = time.perf_counter()
        try:
            wm.full_state_dict()
            result["error"] = "no error"
        except wrapkit.WrapkitError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["seconds"] = time.perf_counter() - t0
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        # Alive and in no collective until rank 0 has given up on its own and written its report.
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.1)
    # The group is unusable now (rank 0 left a collective pending): end without one.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
