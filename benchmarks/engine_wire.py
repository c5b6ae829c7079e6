"""A full sync to an engine in another process against its bare transport, FSDP2 on two gloo ranks, timed
alternately in one run, for SGLang (``SGLangEngine.sync``) and vLLM (``VLLMEngine.sync``):

* **sync**: one whole update session as a trainer calls it: the gathers of ``stream_full_parameters`` (16 MiB
  buckets), the engine's control calls over HTTP, one broadcast per bucket (SGLang) or per packed chunk (vLLM),
  the engine's loads and the checks after them;
* **bare transport**: the same bytes, in the same buckets, broadcast over the same group to the same process,
  which only receives them (no gathers, no control calls, no load).

The ratio is the bare transport's time over the sync's: the sync's share of the wire's throughput (goal: at least
0.8). Since a bucket's gathers end before its send starts (they never interleave: that is how trainers deadlock),
a sync takes at least the gathers' time plus the transport's; the stream's gathers alone are timed too, and the
note gives that bound, ``bare / (bare + gathers)``. The engines are the stand-ins of ``tests/`` (written from
the engines' source), each in a process of its own, holding the same Llama (8 layers, hidden 512, fp32: 75 MB),
on a gloo wire over loopback: a CPU's copies stand in for NCCL, so the figure is the trainer side's overhead,
not a network's.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from _common import alternated, median, print_rows, row, two_ranks, vllm_chunk_sizes

NAME = "engine_wire"
GOAL = 0.8
BUCKET = 16 * 2**20
SIZE = {"layers": 8, "hidden": 512, "vocab": 1024}
ROOT = Path(__file__).resolve().parents[1]


def _sizes(kind: str, engine: Any, wm: Any) -> list[int]:
    """The bytes of each broadcast a sync makes: SGLang's buckets as the stream cuts them, vLLM's packed chunks
    as its cut rule makes them from the metadata."""
    if kind == "sglang":
        return [sum(e.dtype.itemsize * math.prod(e.shape) for e in b.entries)
                for b in wm.stream_full_parameters(BUCKET)]
    return vllm_chunk_sizes(engine, wm, BUCKET)


def _times(kind: str, url: str, port: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama
    from wrapkit.integrations.engines._engine_wire import in_thread
    from wrapkit.integrations.sglang import SGLangEngine
    from wrapkit.integrations.vllm import VLLMEngine

    wm = wrapkit.adapt(build("fsdp2", model=tiny_llama(0, **SIZE)))
    if kind == "sglang":
        engine: Any = SGLangEngine(url, master_port=port, group_name=f"bench-{port}", timeout=120)
    else:
        engine = VLLMEngine(url, master_port=port, backend="gloo", timeout=120, buffer_bytes=BUCKET)
    engine.connect()
    sent: list[Any] = []

    def sync() -> None:
        sent.append(engine.sync(wm, bucket_bytes=BUCKET, pause=True))

    sync()  # vLLM's first sync reads the metadata with one pass of its own: not what a step costs
    sizes = _sizes(kind, engine, wm)  # a pass of the stream: every rank
    group = (engine._group if kind == "sglang" else engine._dense.wire.group) if dist.get_rank() == 0 else None

    def bare() -> None:
        if group is None:
            return
        from wrapkit.integrations.engines._engine_wire import call

        box, thread = in_thread(lambda: call(url, "standin_bare", {"sizes": sizes}, 120))
        for n in sizes:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=group)
        thread.join(120)
        assert box.get("value", {}).get("success"), box

    def gathers() -> None:
        for _ in wm.stream_full_parameters(BUCKET, dst_rank=0):
            pass

    times = alternated([("sync", sync), ("bare", bare), ("gathers", gathers)], reps)
    engine.close()
    last = sent[-1]
    return {"times": times, "bytes": last.bytes, "broadcasts": last.buckets, "tensors": last.tensors}


def run(quick: bool = False) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    from tests.harness.standin_http import Standin
    from wrapkit.cli._workers import free_port

    reps = 3 if quick else 7
    rows = []
    with two_ranks() as group:
        for kind, script in (("sglang", "sglang_standin.py"), ("vllm", "vllm_server_standin.py")):
            server = Standin(ROOT / "tests" / "engines" / script)
            try:
                server.mode(size=SIZE)
                obs = group.run(_times, kind, server.url, free_port(), reps, timeout=600)[0]
            finally:
                server.stop()
            t = obs["times"]
            bare, gathers = median(t["bare"]), median(t["gathers"])
            rows.append(row(f"{kind} sync vs bare transport", median(t["sync"]), median(t["bare"]), GOAL,
                            better="higher", samples=(t["sync"], t["bare"]),
                            note=f"throughput ratio; bound {bare / (bare + gathers):.2f} (gathers alone "
                                 f"{gathers:.3f} s); {obs['bytes'] / 2**20:.0f} MB, {obs['tensors']} tensors in "
                                 f"{obs['broadcasts']} broadcasts, median of {reps}"))
    return rows


if __name__ == "__main__":
    print_rows("a sync to an engine in another process vs its bare transport", run())
