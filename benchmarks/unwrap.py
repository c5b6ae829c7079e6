"""``wm.config`` + ``wm.unwrap()`` per call vs accelerate's
``extract_model_from_parallel(model).config`` on DDP(compile(Llama)). Goal: >= 10x faster.

A trainer calls these on every step (often several times), so the per-call cost
is what matters; the adapter is made once, as a trainer would keep it.
"""

from __future__ import annotations

import os
import tempfile
import timeit
from typing import Any

import torch
import torch.distributed as dist
from _common import print_rows, row

NAME = "unwrap"
GOAL = 10.0


def run(quick: bool = False) -> list[dict[str, Any]]:
    from accelerate.utils import extract_model_from_parallel

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    number = 2_000 if quick else 20_000
    owns_group = not dist.is_initialized()
    store = tempfile.mkdtemp()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(store, 'store')}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.compile(tiny_llama(), backend="eager"))
        wm = wrapkit.adapt(model)
        assert wm.config is extract_model_from_parallel(model).config

        def with_wrapkit() -> Any:
            return wm.config, wm.unwrap()

        def with_accelerate() -> Any:
            inner = extract_model_from_parallel(model)
            return inner.config, inner

        def adapt_each_call() -> Any:
            w = wrapkit.adapt(model)
            return w.config, w.unwrap()

        for fn in (with_wrapkit, with_accelerate, adapt_each_call):
            fn()
        acc = [t / number for t in timeit.repeat(with_accelerate, number=number, repeat=5)]
        wk = [t / number for t in timeit.repeat(with_wrapkit, number=number, repeat=5)]
        each = [t / number for t in timeit.repeat(adapt_each_call, number=number, repeat=5)]
    finally:
        if owns_group:
            dist.destroy_process_group()
    # The ratio is wrapkit's speed-up over accelerate.
    return [
        # Each way's repeats ran in a block of their own: not pairs.
        row("DDP(compile(Llama))", min(wk), min(acc), GOAL, better="higher", note="per call, adapter kept",
            samples=(wk, acc), paired=False),
        row("adapt() every call", min(each), min(acc), 1.0, better="higher", note="adapter rebuilt per call",
            samples=(each, acc), paired=False),
    ]


if __name__ == "__main__":
    print_rows("wm.config + wm.unwrap() vs accelerate's extract_model_from_parallel", run())
