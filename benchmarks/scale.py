"""Models of three sizes (about 25 MB, 250 MB and 1 GB of fp32 weights) on two gloo ranks:
per-rank peak memory and time of ``generation`` ("full" and "layerwise"), ``save_pretrained``,
``load``, ``copy_to`` and ``prepare_reference``, next to the model's size.

Memory is the process's peak anonymous resident memory during the operation (sampled every
millisecond) above what the rank held before, plus the rank's own parameter shards: what the
operation allocates, CPU copies included (the page cache of files read or written is not
counted: the kernel reclaims it). Goals:
for ``save_pretrained``, ``load`` and layerwise generation, at most 1/N of the model plus one
checkpoint file (``save``/``load``), and for layerwise generation a parameter peak (what the
rank's parameters take at every module boundary) of at most 1/N plus the two largest units, each
as a ratio that must stay <= 1; and time per MB flat as the size grows, within 1.5x (the largest
size's time per MB over the next one's; at 25 MB fixed costs dominate, and its figures are shown
beside them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch
from _common import print_rows, row, two_ranks

NAME = "scale"
# (label, layers, hidden, vocab): 9 h^2 per block (attention 3 h^2 with two KV heads of four, MLP 6 h^2)
# plus 2 * vocab * h of embeddings and head.
SIZES = [("25MB", 8, 256, 3072), ("250MB", 10, 768, 8192), ("1GB", 11, 1536, 8192)]
OPS = ("generation full", "generation layerwise", "save_pretrained", "load", "copy_to", "prepare_reference")
MEMORY_GOAL = 1.0
FLAT_GOAL = 1.5
NEW_TOKENS = 8
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _anon() -> int:
    """Anonymous resident bytes of this process: tensors and heap, not the file pages a read maps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn: Any) -> tuple[float, int]:
    """(seconds, peak anonymous memory above the start) of ``fn()``, sampled every millisecond by
    a thread; every rank starts together."""
    import threading

    import torch.distributed as dist

    dist.barrier()
    start = _anon()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], _anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    return seconds, max(0, max(peak[0], _anon()) - start)


def _worker(spec: str, layers: int, hidden: int, vocab: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama

    torch.set_num_threads(1)  # two ranks on two cores
    model = build(spec, model=tiny_llama(0, layers=layers, hidden=hidden, vocab=vocab))
    wm = wrapkit.adapt(model)
    full_bytes = 4 * wm.num_parameters()
    # The two largest units: the root's own (embeddings, head, final norm) and a block.
    block = 4 * 9 * hidden * hidden
    root = 4 * (2 * vocab * hidden + hidden)
    file_bytes = max(full_bytes // 8, 1 << 20)
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    path = os.path.join(directory, "ckpt")

    params_peak = [0]

    def note(*_: Any) -> None:
        params_peak[0] = max(params_peak[0], wm.resident_parameter_bytes())

    def generate(gather: str) -> None:
        with wm.generation(gather=gather) as m:
            # The parameter bytes held at every module boundary: the shard plus the gathered units.
            hooks = [h for mod in m.modules() for h in (mod.register_forward_pre_hook(note),
                                                       mod.register_forward_hook(note))]
            try:
                m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
            finally:
                for h in hooks:
                    h.remove()

    ref: list[Any] = []
    steps = {
        "generation full": lambda: generate("full"),
        "generation layerwise": lambda: generate("layerwise"),
        "save_pretrained": lambda: wm.save_pretrained(path, max_shard_size=file_bytes),
        "load": lambda: wm.load(path),
        "prepare_reference": lambda: ref.append(wrapkit.prepare_reference(wm)),
        "copy_to": lambda: wm.copy_to(ref[0]),
    }
    out: dict[str, Any] = {"full_bytes": full_bytes, "two_units": sum(sorted([block, block, root])[-2:]),
                           "file_bytes": file_bytes,
                           "world": dist.get_world_size(), "shard_bytes": wm.resident_parameter_bytes()}
    # Warm-up: lazy inits and first-call costs are not what is measured (a trained model has run
    # its backend's forward before; FSDP2 sets up its all-gather state on the first one).
    generate("full")
    with wm.generation(gather="layerwise") as m:
        m(prompt)
    for op, fn in steps.items():
        params_peak[0] = 0
        out[op] = _measure(fn)
        if op == "generation layerwise":
            out["layerwise parameters"] = params_peak[0]
    return out


def run(quick: bool = False, spec: str = "fsdp2") -> list[dict[str, Any]]:
    sizes = SIZES[:2] if quick else SIZES
    rows: list[dict[str, Any]] = []
    per_mb: dict[str, list[float]] = {op: [] for op in OPS}
    # glibc keeps freed blocks of up to 32 MB in its heap, where they count as resident until
    # reused; a fixed mmap threshold returns every large block to the system when freed, so
    # the resident set follows the live tensors. Set before the worker processes start.
    saved = {k: os.environ.get(k) for k in _MALLOC}
    os.environ.update(_MALLOC)
    try:
        group = two_ranks()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with group:
        for label, layers, hidden, vocab in sizes:
            directory = tempfile.mkdtemp(prefix="wrapkit-scale-")
            try:
                ranks = group.run(_worker, spec, layers, hidden, vocab, directory, timeout=1200)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            r0 = ranks[0]
            mb = r0["full_bytes"] / 1e6
            for op in OPS:
                seconds = max(r[op][0] for r in ranks)
                peak = max(r[op][1] + r["shard_bytes"] for r in ranks)
                per_mb[op].append(seconds / mb)
                extra = {"size_mb": mb, "op": op, "seconds": seconds, "peak_mb": peak / 1e6}
                if op in ("save_pretrained", "load"):
                    bound = r0["full_bytes"] / r0["world"] + r0["file_bytes"]
                    rows.append({**row(f"{label} {op} peak memory", peak, bound, MEMORY_GOAL, unit="B",
                                       note="per-rank peak / (model/N + one checkpoint file)"), **extra})
                elif op == "generation layerwise":
                    params = max(r["layerwise parameters"] for r in ranks)
                    bound = r0["full_bytes"] / r0["world"] + r0["two_units"]
                    rows.append(row(f"{label} {op} peak parameters", params, bound, MEMORY_GOAL, unit="B",
                                    note="per-rank parameter bytes / (model/N + the two largest units)"))
                    rows.append({**row(f"{label} {op} peak memory", peak, r0["full_bytes"], float("inf"),
                                       unit="B", note="per-rank peak / the model (no goal)"), **extra})
                else:
                    rows.append({**row(f"{label} {op} peak memory", peak, r0["full_bytes"], float("inf"),
                                       unit="B", note="per-rank peak / the model (no goal)"), **extra})
        for op in OPS:
            xs = per_mb[op]
            # The two largest sizes: at the smallest, fixed costs (agreements, per-token overheads) dominate.
            rows.append(row(f"{op} time per MB ({sizes[-1][0]} / {sizes[-2][0]})", xs[-1], xs[-2], FLAT_GOAL,
                            unit="s/MB", note=", ".join(f"{x * 1e3:.2f} ms/MB" for x in xs)))
    return rows


if __name__ == "__main__":
    print_rows("per-rank memory and time against model size (fsdp2, two ranks)", run())
