"""Time of ``save_state`` / ``load_state`` against each backend's own way of saving the training state.

Two gloo ranks on the CPU; a Llama of 8 layers, hidden 512 (256 with ``--quick``) and a 4096-token vocabulary,
with AdamW after one step, so every moment exists. The baselines:

- FSDP2 and FSDP1: torch's distributed checkpoint with ``get_state_dict`` (save) and ``set_state_dict`` (load),
  the way torchtitan and accelerate save a torch-native model and its optimizer;
- ZeRO-2 and ZeRO-3: ``engine.save_checkpoint`` / ``engine.load_checkpoint``. DeepSpeed leaves what it wrote in
  the page cache, where a crash of the machine loses it, while ``save_state`` and DCP flush every file to disk
  (``fsync``) before the directory is renamed into place: the baseline's save is ``save_checkpoint`` followed by
  the same flush of the files each rank wrote, so both sides do the same work. The note gives how much of the
  baseline's time that flush was.

Every save goes to a new checkpoint (a directory, or a DeepSpeed tag), as a trainer saves ``checkpoint-<step>``,
and starts with nothing waiting to be written to disk (``os.sync()`` first, untimed): neither side pays for the
other's earlier writes. Each checkpoint goes once loaded (the last stays), as a trainer keeps its last few, so the
page cache does not fill up over the run.

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
HIDDEN = {False: 512, True: 256}  # by ``quick``: 8 layers, 25M or 7M parameters


def _peak_of(fn: Any) -> tuple[float, int]:
    """(Seconds, peak extra resident bytes) of ``fn()`` on this rank, started together on every rank."""
    import torch.distributed as dist

    from benchmarks._common import proc_status, reset_peak

    os.sync()  # no earlier save's pages still waiting for the disk: each side pays for its own writes only
    dist.barrier()
    reset_peak()
    base = proc_status("VmRSS")
    t0 = time.perf_counter()
    fn()
    secs = time.perf_counter() - t0
    dist.barrier()
    return secs, proc_status("VmHWM") - base


def _model(hidden: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _trained(backend: str, hidden: int) -> tuple[Any, Any]:
    import torch

    import wrapkit
    from wrapkit.cli._models import build

    torch.manual_seed(0)
    wm = wrapkit.adapt(build(backend, model=_model(hidden)))
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    # Built before the forward: FSDP2 swaps unsharded tensors in while it runs.
    opt = None if wm.backend == "deepspeed" else torch.optim.AdamW(wm.module.parameters(), lr=1e-3)
    loss = wm(input_ids=ids, labels=ids).loss
    if opt is None:
        wm.module.backward(loss)
        wm.module.step()
        return wm, None
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return wm, opt


def _flush(directory: str, rank: int) -> None:
    """Flush to disk what this rank wrote of a DeepSpeed checkpoint ``<save_dir>/<tag>``, as ``save_state`` does
    its own files: its optimizer partition (``zero_pp_rank_<rank>_...``), on rank 0 also the module's states and
    ``latest``, then the directories."""
    def fsync(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    parent = os.path.dirname(directory)
    for name in sorted(os.listdir(directory)):
        if f"rank_{rank}_" in name if name.startswith("zero_pp_") else rank == 0:
            fsync(os.path.join(directory, name))
    if rank == 0:
        if os.path.exists(os.path.join(parent, "latest")):
            fsync(os.path.join(parent, "latest"))
        fsync(directory)
        fsync(parent)


def _ways(wm: Any, opt: Any, root: str, flushed: list[float]) -> dict[str, dict[str, Any]]:
    """Each side's save and load into checkpoint ``k`` (a new directory, or DeepSpeed tag, per save: as a trainer
    saves ``checkpoint-<step>``), as callables taking ``k``. ``flushed`` collects the seconds of DeepSpeed's flush."""
    def ours(k: int) -> str:
        return os.path.join(root, f"wrapkit-{k}")

    sides: dict[str, dict[str, Any]] = {"wrapkit": {"save": lambda k: wm.save_state(ours(k), opt),
                                                    "load": lambda k: wm.load_state(ours(k), opt), "path": ours}}
    if wm.backend == "deepspeed":
        import torch.distributed as dist

        engine, own = wm.module, os.path.join(root, "own")

        def durable(k: int) -> None:
            engine.save_checkpoint(own, tag=f"t{k}")
            t0 = time.perf_counter()
            _flush(os.path.join(own, f"t{k}"), dist.get_rank())
            flushed.append(time.perf_counter() - t0)
        sides["own"] = {"save": durable,
                        "load": lambda k: engine.load_checkpoint(own, tag=f"t{k}"),
                        "path": lambda k: os.path.join(own, f"t{k}")}
        return sides
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save(k: int) -> None:
        msd, osd = get_state_dict(wm.module, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"own-{k}"))

    def load(k: int) -> None:
        msd, osd = get_state_dict(wm.module, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(root, f"own-{k}"))
        set_state_dict(wm.module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sides["own"] = {"save": save, "load": load, "path": lambda k: os.path.join(root, f"own-{k}")}
    return sides


def _share(directory: str) -> int:
    """Bytes of this rank's share of the training state: what it wrote of it (its weights and moments)."""
    import torch.distributed as dist

    return os.path.getsize(os.path.join(directory, f"__{dist.get_rank()}_0.distcp"))


def _bytes(directory: str) -> int:
    """Bytes of every file of a checkpoint (every rank's)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def measure(root: str, reps: int, hidden: int, backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """Runs on every rank: {backend: {side: {op: ([seconds...], [peak bytes...])}, "share": bytes, "flushed":
    [seconds of DeepSpeed's flush...], "bytes": {side: bytes of its last checkpoint}}}."""
    import torch.distributed as dist

    from wrapkit._imports import is_available

    out: dict[str, Any] = {}
    for backend in backends:
        if backend.startswith("zero") and not is_available("deepspeed"):
            continue
        wm, opt = _trained(backend, hidden)
        flushed: list[float] = []
        sides = _ways(wm, opt, os.path.join(root, backend), flushed)
        times: dict[str, Any] = {s: {"save": ([], []), "load": ([], [])} for s in ("wrapkit", "own")}
        for i in range(reps + 1):  # the first pair warms both up and is not counted
            for side in (("wrapkit", "own") if i % 2 else ("own", "wrapkit")):
                for op in ("save", "load"):
                    secs, peak = _peak_of(lambda: sides[side][op](i))  # noqa: B023 - called at once
                    if i:
                        times[side][op][0].append(secs)
                        times[side][op][1].append(peak)
                if i < reps and dist.get_rank() == 0:  # as a trainer keeps its last few: the page cache stays small
                    shutil.rmtree(sides[side]["path"](i))
        out[backend] = {**times, "share": _share(os.path.join(root, backend, f"wrapkit-{reps}")),
                        "flushed": flushed[1:], "bytes": {s: _bytes(sides[s]["path"](reps)) for s in sides}}
        del wm, opt
        dist.barrier()
    return out


def collect(quick: bool = False, hidden: int | None = None, backends: tuple[str, ...] = BACKENDS,
            reps: int | None = None) -> dict[str, Any]:
    from _common import two_ranks

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    root = tempfile.mkdtemp(prefix="wrapkit-resume-")
    try:
        with two_ranks() as group:
            per_rank = group.run("benchmarks.resume:measure", root, reps or (2 if quick else 5),
                                 hidden or HIDDEN[quick], backends, timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    out: dict[str, Any] = {}
    for backend in per_rank[0]:
        flushed = zip(*(r[backend]["flushed"] for r in per_rank), strict=True)
        entry: dict[str, Any] = {"share": max(r[backend]["share"] for r in per_rank),
                                 "flushed": [max(f) for f in flushed], "bytes": per_rank[0][backend]["bytes"]}
        for side in ("wrapkit", "own"):
            for op in ("save", "load"):
                runs = len(per_rank[0][backend][side][op][0])
                # The slower rank's time, the larger rank's peak.
                secs = [max(r[backend][side][op][0][i] for r in per_rank) for i in range(runs)]
                peak = max(max(r[backend][side][op][1]) for r in per_rank)
                entry[(side, op)] = (secs, peak)
        out[backend] = entry
    return out


def run(quick: bool = False, hidden: int | None = None, backends: tuple[str, ...] = BACKENDS,
        reps: int | None = None) -> list[dict[str, Any]]:
    """For ``wrapkit bench``: save and load time against the backend's own, per backend."""
    from _common import median, row

    rows = []
    for backend, entry in collect(quick, hidden, backends, reps).items():
        share = entry["share"] / 2**20
        for op in ("save", "load"):
            (ours, our_peak), (own, own_peak) = entry[("wrapkit", op)], entry[("own", op)]
            pairs = sorted(a / b for a, b in zip(ours, own, strict=True))
            note = (f"pairs {pairs[0]:.2f}-{pairs[-1]:.2f}x; peak extra memory {our_peak / 2**20:.1f} MiB (own way "
                    f"{own_peak / 2**20:.1f}) for a {share:.1f} MiB share")
            if op == "save":
                written = entry["bytes"]
                note += f"; writes {written['wrapkit'] / 2**20:.1f} MiB (own way {written['own'] / 2**20:.1f})"
                if entry["flushed"]:
                    note += f"; of the own way's time its flush to disk {median(entry['flushed']):.3g} s"
            rows.append(row(f"{backend} {op}", median(ours), median(own), GOAL, samples=(ours, own), note=note))
    return rows


def main(argv: list[str]) -> int:
    """``python benchmarks/resume.py [--hidden N] [--reps N] [backend ...]``: all four backends at hidden 512, five
    pairs each, by default."""
    from _common import print_rows

    hidden = int(argv[argv.index("--hidden") + 1]) if "--hidden" in argv else None
    reps = int(argv[argv.index("--reps") + 1]) if "--reps" in argv else None
    named = tuple(a for a in argv if a in BACKENDS)
    print_rows(f"save_state / load_state against the backend's own, 2 gloo ranks (slower rank), hidden "
               f"{hidden or HIDDEN[False]}", run(hidden=hidden, backends=named or BACKENDS, reps=reps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
