"""Launched by test_shutdown: a run that ends with ``wrapkit.shutdown()`` after DDP on gloo (which
keeps the group's threads alive to the end) or after plain collectives, with an ``atexit`` handler
and a file left open and unflushed, both of which must still reach the disk."""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist

import wrapkit


def main() -> None:
    out, kind = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
        for _ in range(3):
            model(torch.ones(2, 3)).sum().backward()
    else:
        t = torch.ones(3)
        dist.all_reduce(t)
    log = open(os.path.join(out, f"log{rank}.txt"), "w")  # noqa: SIM115 - left open on purpose
    log.write("written, never flushed\n")

    def at_exit() -> None:
        with open(os.path.join(out, f"atexit{rank}.txt"), "w") as f:
            f.write("ran\n")
    atexit.register(at_exit)
    wrapkit.shutdown()
    raise AssertionError("shutdown() returned")


if __name__ == "__main__":
    main()
