"""Models of three sizes (about 25 MB, 250 MB and 1 GB of fp32 weights) on two gloo ranks:
per-rank peak memory and time of ``generation`` ("full" and "layerwise"), ``save_pretrained``,
``load``, ``copy_to`` and ``prepare_reference``, next to the model's size.

Memory is the process's peak resident set during the operation (``VmHWM``, reset before it
through ``/proc/self/clear_refs``), on top of what the rank held before, plus the rank's own
parameter shards: everything the operation costs, CPU copies and file pages included. Goals:
for ``save_pretrained``, ``load`` and layerwise generation, at most 1/N of the model plus one
checkpoint file (``save``/``load``) or two transformer blocks (layerwise), as a ratio that must
stay <= 1; and time per MB flat across the sizes, within 1.5x (largest over smallest).
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


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _measure(fn: Any) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of ``fn()``; every rank starts together."""
    import torch.distributed as dist

    dist.barrier()
    _reset_peak()
    start_rss = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, _status("VmHWM") - start_rss)


def _worker(spec: str, layers: int, hidden: int, vocab: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama

    torch.set_num_threads(1)  # two ranks on two cores
    model = build(spec, model=tiny_llama(0, layers=layers, hidden=hidden, vocab=vocab))
    wm = wrapkit.adapt(model)
    full_bytes = 4 * wm.num_parameters()
    block = 4 * 9 * hidden * hidden
    file_bytes = max(full_bytes // 8, 1 << 20)
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    path = os.path.join(directory, "ckpt")

    def generate(gather: str) -> None:
        with wm.generation(gather=gather) as m:
            m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                       min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)

    ref: list[Any] = []
    steps = {
        "generation full": lambda: generate("full"),
        "generation layerwise": lambda: generate("layerwise"),
        "save_pretrained": lambda: wm.save_pretrained(path, max_shard_size=file_bytes),
        "load": lambda: wm.load(path),
        "prepare_reference": lambda: ref.append(wrapkit.prepare_reference(wm)),
        "copy_to": lambda: wm.copy_to(ref[0]),
    }
    out: dict[str, Any] = {"full_bytes": full_bytes, "block_bytes": block, "file_bytes": file_bytes,
                           "world": dist.get_world_size(), "shard_bytes": wm.resident_parameter_bytes()}
    generate("full")  # warm-up: lazy inits and first-call costs are not what is measured
    for op, fn in steps.items():
        out[op] = _measure(fn)
    return out


def run(quick: bool = False, spec: str = "fsdp2") -> list[dict[str, Any]]:
    sizes = SIZES[:2] if quick else SIZES
    rows: list[dict[str, Any]] = []
    per_mb: dict[str, list[float]] = {op: [] for op in OPS}
    with two_ranks() as group:
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
                bound = None
                if op in ("save_pretrained", "load"):
                    bound = r0["full_bytes"] / r0["world"] + r0["file_bytes"]
                elif op == "generation layerwise":
                    bound = r0["full_bytes"] / r0["world"] + 2 * r0["block_bytes"]
                if bound is not None:
                    rows.append({**row(f"{label} {op} peak memory", peak, bound, MEMORY_GOAL, unit="B",
                                       note="per-rank peak / (model/N + one file or two blocks)"), **extra})
                else:
                    rows.append({**row(f"{label} {op} peak memory", peak, r0["full_bytes"], float("inf"),
                                       unit="B", note="per-rank peak / the model (no goal)"), **extra})
        for op in OPS:
            xs = per_mb[op]
            rows.append(row(f"{op} time per MB (largest / smallest)", max(xs), min(xs), FLAT_GOAL, unit="s/MB",
                            note=", ".join(f"{x * 1e3:.2f} ms/MB" for x in xs)))
    return rows


if __name__ == "__main__":
    print_rows("per-rank memory and time against model size (fsdp2, two ranks)", run())
