"""Time of ``save_state`` / ``load_state`` against each backend's own way of saving the training state.

Two gloo ranks on the CPU; the benchmark Llama of ``generation.py`` (8 layers, hidden 256, a 4096-token
vocabulary) with AdamW after one step, so every moment exists. The baselines:

- FSDP2 and FSDP1: torch's distributed checkpoint with ``get_state_dict`` (save) and ``set_state_dict`` (load),
  the way torchtitan and accelerate save a torch-native model and its optimizer;
- ZeRO-2 and ZeRO-3: ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Each side is timed in interleaved pairs (``_common.interleaved``), the slower rank's time counting. The goal is
at most 1.1x the backend's own. The note gives each side's peak extra resident memory on the worse rank (after
``MALLOC_MMAP_THRESHOLD_`` lowers the allocator's reuse, as ``export.py`` does), against this rank's share of the
state (its weights and moments). Linux only. Run: ``python benchmarks/resume.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "resume"
GOAL = 1.1
BACKENDS = ("fsdp2", "fsdp", "zero2", "zero3")
VOCAB = 4096


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_of(fn: Any) -> tuple[float, int]:
    """(Seconds, peak extra resident bytes) of ``fn()`` on this rank, started together on every rank."""
    import torch.distributed as dist

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    secs = time.perf_counter() - t0
    dist.barrier()
    return secs, _status("VmHWM") - base


def _trained(backend: str) -> tuple[Any, Any]:
    import torch

    import wrapkit
    from benchmarks.generation import llama
    from wrapkit.cli._models import build

    wm = wrapkit.adapt(build(backend, model=llama(vocab=VOCAB)))
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = wm(input_ids=ids, labels=ids).loss
    if wm.backend == "deepspeed":
        wm.module.backward(loss)
        wm.module.step()
        return wm, None
    opt = torch.optim.AdamW(wm.module.parameters(), lr=1e-3)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return wm, opt


def _own_ways(wm: Any, opt: Any, directory: str) -> tuple[Any, Any]:
    """The backend's own save and load of the model and optimizer state, as callables."""
    if wm.backend == "deepspeed":
        engine = wm.module
        return (lambda: engine.save_checkpoint(directory, tag="t"),
                lambda: engine.load_checkpoint(directory, tag="t"))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save() -> None:
        msd, osd = get_state_dict(wm.module, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)

    def load() -> None:
        msd, osd = get_state_dict(wm.module, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(wm.module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return save, load


def _share(wm: Any, opt: Any) -> int:
    """Bytes of this rank's share of the training state: its weights (fp32 masters) and moments."""
    if wm.backend == "deepspeed":
        zero = wm.module.optimizer
        inner = zero.optimizer
        flats = [p for g in inner.param_groups for p in g["params"]]
        return sum(t.numel() * t.element_size() for f in flats
                   for t in (f, *(v for v in inner.state[f].values() if v.dim())))
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t
    return sum(t.numel() * t.element_size() for p, st in opt.state.items()
               for t in (local(p), *(local(v) for v in st.values() if v.dim())))


def measure(root: str, reps: int) -> dict[str, Any]:
    """Runs on every rank: {backend: {side: {op: ([seconds...], [peak bytes...])}, "share": bytes}}."""
    import torch.distributed as dist

    from wrapkit._imports import is_available

    out: dict[str, Any] = {}
    for backend in BACKENDS:
        if backend.startswith("zero") and not is_available("deepspeed"):
            continue
        wm, opt = _trained(backend)
        ours = os.path.join(root, backend, "wrapkit")
        own_save, own_load = _own_ways(wm, opt, os.path.join(root, backend, "own"))
        sides: dict[str, Any] = {
            "wrapkit": {"save": lambda wm=wm, opt=opt, d=ours: wm.save_state(d, opt),
                        "load": lambda wm=wm, opt=opt, d=ours: wm.load_state(d, opt)},
            "own": {"save": own_save, "load": own_load},
        }
        times: dict[str, Any] = {s: {"save": ([], []), "load": ([], [])} for s in sides}
        for i in range(reps + 1):  # the first pair warms both up and is not counted
            for side in (("wrapkit", "own") if i % 2 else ("own", "wrapkit")):
                for op in ("save", "load"):
                    secs, peak = _peak_of(sides[side][op])
                    if i:
                        times[side][op][0].append(secs)
                        times[side][op][1].append(peak)
        out[backend] = {**times, "share": _share(wm, opt)}
        del wm, opt
        dist.barrier()
    return out


def collect(quick: bool = False) -> dict[str, Any]:
    from _common import two_ranks

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    root = tempfile.mkdtemp(prefix="wrapkit-resume-")
    try:
        with two_ranks() as group:
            per_rank = group.run("benchmarks.resume:measure", root, 2 if quick else 5, timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    out: dict[str, Any] = {}
    for backend in per_rank[0]:
        entry: dict[str, Any] = {"share": max(r[backend]["share"] for r in per_rank)}
        for side in ("wrapkit", "own"):
            for op in ("save", "load"):
                runs = len(per_rank[0][backend][side][op][0])
                # The slower rank's time, the larger rank's peak.
                secs = [max(r[backend][side][op][0][i] for r in per_rank) for i in range(runs)]
                peak = max(max(r[backend][side][op][1]) for r in per_rank)
                entry[(side, op)] = (secs, peak)
        out[backend] = entry
    return out


def run(quick: bool = False) -> list[dict[str, Any]]:
    """For ``wrapkit bench``: save and load time against the backend's own, per backend."""
    from _common import median, row

    rows = []
    for backend, entry in collect(quick).items():
        share = entry["share"] / 2**20
        for op in ("save", "load"):
            (ours, our_peak), (own, own_peak) = entry[("wrapkit", op)], entry[("own", op)]
            rows.append(row(f"{backend} {op}", median(ours), median(own), GOAL, samples=(ours, own),
                            note=f"peak extra memory {our_peak / 2**20:.1f} MiB (own way {own_peak / 2**20:.1f}) "
                                 f"for a {share:.1f} MiB share"))
    return rows


def main() -> int:
    from _common import print_rows

    print_rows("save_state / load_state against the backend's own, 2 gloo ranks (slower rank)", run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
