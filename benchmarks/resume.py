"""Time of ``save_state`` / ``load_state`` against each backend's own way of saving the training state.

Two gloo ranks on the CPU; a Llama of 8 layers, hidden 512 (256 with ``--quick``) and a 4096-token vocabulary,
with AdamW after one step, so every moment exists. The baselines:

- FSDP2 and FSDP1: torch's distributed checkpoint with ``get_state_dict`` (save) and ``set_state_dict`` (load),
  the way torchtitan and accelerate save a torch-native model and its optimizer;
- ZeRO-2 and ZeRO-3: ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Every save goes to a new checkpoint (a directory, or a DeepSpeed tag), as a trainer saves ``checkpoint-<step>``.

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


def _ways(wm: Any, opt: Any, root: str) -> dict[str, dict[str, Any]]:
    """Each side's save and load into checkpoint ``k`` (a new directory, or DeepSpeed tag, per save: as a trainer
    saves ``checkpoint-<step>``), as callables taking ``k``."""
    def ours(k: int) -> str:
        return os.path.join(root, f"wrapkit-{k}")

    sides: dict[str, dict[str, Any]] = {"wrapkit": {"save": lambda k: wm.save_state(ours(k), opt),
                                                    "load": lambda k: wm.load_state(ours(k), opt)}}
    if wm.backend == "deepspeed":
        engine, own = wm.module, os.path.join(root, "own")
        sides["own"] = {"save": lambda k: engine.save_checkpoint(own, tag=f"t{k}"),
                        "load": lambda k: engine.load_checkpoint(own, tag=f"t{k}")}
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
    sides["own"] = {"save": save, "load": load}
    return sides


def _share(directory: str) -> int:
    """Bytes of this rank's share of the training state: what it wrote of it (its weights and moments)."""
    import torch.distributed as dist

    return os.path.getsize(os.path.join(directory, f"__{dist.get_rank()}_0.distcp"))


def measure(root: str, reps: int, hidden: int) -> dict[str, Any]:
    """Runs on every rank: {backend: {side: {op: ([seconds...], [peak bytes...])}, "share": bytes}}."""
    import torch.distributed as dist

    from wrapkit._imports import is_available

    out: dict[str, Any] = {}
    for backend in BACKENDS:
        if backend.startswith("zero") and not is_available("deepspeed"):
            continue
        wm, opt = _trained(backend, hidden)
        sides = _ways(wm, opt, os.path.join(root, backend))
        times: dict[str, Any] = {s: {"save": ([], []), "load": ([], [])} for s in sides}
        for i in range(reps + 1):  # the first pair warms both up and is not counted
            for side in (("wrapkit", "own") if i % 2 else ("own", "wrapkit")):
                for op in ("save", "load"):
                    secs, peak = _peak_of(lambda: sides[side][op](i))  # noqa: B023 - called at once
                    if i:
                        times[side][op][0].append(secs)
                        times[side][op][1].append(peak)
        out[backend] = {**times, "share": _share(os.path.join(root, backend, f"wrapkit-{reps}"))}
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
            per_rank = group.run("benchmarks.resume:measure", root, 2 if quick else 5, HIDDEN[quick], timeout=900)
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
