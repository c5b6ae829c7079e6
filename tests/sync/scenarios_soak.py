"""The soak: many cycles of what an online-RL trainer does between steps, on one model, checked
for growth (memory, file descriptors, temporary files), for drift (hooks, attributes,
parameter objects) and against a control run that makes the same training steps alone."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.references.scenarios_reference import TOKENS, _Trainer
from wrapkit._registry import as_adapter
from wrapkit.cli._models import build
from wrapkit.references.placement import move_verified

PROMPT = TOKENS[:1, :4]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _structure(model: torch.nn.Module) -> list[Any]:
    """What must be the same after any number of cycles: every module's attribute names and
    hooks, and every parameter object."""
    return [
        [(n, id(p)) for n, p in model.named_parameters()],
        [(name, sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks),
          len(m._backward_hooks), len(getattr(m, "_state_dict_hooks", {})))
         for name, m in model.named_modules()],
    ]


def soak(spec: str, cycles: int, warmup: int) -> dict[str, Any]:
    """``cycles`` of generation(), a training step, copy_to(ref, alpha=0.1) and an offload to the
    CPU and back; the losses against a control model trained alone."""
    control = _Trainer(wrapkit.adapt(build(spec)))
    control_losses = [control.step() for _ in range(cycles)]
    del control
    gc.collect()

    wm = wrapkit.adapt(build(spec))
    ref = wrapkit.prepare_reference(wm)
    trainer = _Trainer(wm)
    tmp = tempfile.mkdtemp(prefix="wrapkit-soak-")
    tempfile.tempdir, old_tempdir = tmp, tempfile.tempdir
    losses: list[float] = []
    rss: list[int] = []
    start = time.perf_counter()
    try:
        for i in range(cycles):
            if i == warmup:
                gc.collect()
                baseline = {"rss": _rss(), "fds": _fds(), "structure": _structure(wm.module),
                            "ref_structure": _structure(ref.module)}
            with wm.generation() as m:
                m.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0)
            losses.append(trainer.step())
            wm.copy_to(ref, alpha=0.1)
            wm.place("cpu")
            # The CPU is the only device here: a copy into fresh storage is what an offload does.
            move_verified(as_adapter(wm), torch.device("cpu"), copy=True)
            wm.place()
            gc.collect()
            rss.append(_rss())
        seconds = time.perf_counter() - start
    finally:
        tempfile.tempdir = old_tempdir
    leftovers = os.listdir(tmp)
    os.rmdir(tmp) if not leftovers else None
    dist.barrier()
    return {
        "cycles": cycles,
        "seconds": seconds,
        "rss_warm": baseline["rss"],
        "rss_end": rss[-1],
        "rss_max": max(rss[warmup:]),
        "fds": (baseline["fds"], _fds()),
        "structure_same": _structure(wm.module) == baseline["structure"],
        "ref_structure_same": _structure(ref.module) == baseline["ref_structure"],
        "temp_files": leftovers,
        "losses": losses,
        "control_losses": control_losses,
    }
