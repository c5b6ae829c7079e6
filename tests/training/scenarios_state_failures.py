"""Scenarios for the training state when things go wrong, from a model that has taken a step: a save that fails
partway on one rank (its file writes refused, as on a full disk), a checkpoint damaged or written by another
tool, optimizers inside containers, and an optimizer over another model."""

from __future__ import annotations

import glob
import json
import os
import pickle
import resource
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.training.scenarios_resume import _optimizer, _steps
from wrapkit.cli._models import build


class Container(torch.optim.Optimizer):
    """Shaped like torchtitan's ``OptimizersContainer``: a torch ``Optimizer`` over every parameter whose own
    ``state`` stays empty, the optimizers that step in ``.optimizers``."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Wrapper:
    """Shaped like accelerate's ``AcceleratedOptimizer``: the optimizer inside as ``.optimizer``, its param groups
    and state passed through."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state


@contextmanager
def _writes_refused(on: bool) -> Iterator[None]:
    """Files this process writes stop growing past 1 KB (the kernel refuses the write, EFBIG), as a full disk
    would stop them; the signal the kernel sends with it is ignored so that the write fails instead."""
    if not on:
        yield
        return
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_signal)


def _files(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def _error(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` raised: its class, whether typed, its message and the chained cause's class."""
    try:
        call()
    except BaseException as exc:  # noqa: B036 - what escapes is the point, BaseException included
        cause = exc.__cause__
        return {"type": type(exc).__name__, "typed": isinstance(exc, wrapkit.WrapkitError), "message": str(exc),
                "cause": type(cause).__name__ if cause is not None else None}
    return {"type": None, "typed": False, "message": "", "cause": None}


def _moments(opt: Any) -> dict[str, torch.Tensor]:
    """Every state tensor of a torch optimizer (or of each inside a container), by position."""
    inner = getattr(opt, "optimizers", [opt])
    out = {}
    for i, o in enumerate(inner):
        for j, p in enumerate(p for g in o.param_groups for p in g["params"]):
            for k, v in o.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"{i}/{j}/{k}"] = v.detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _shared_dir(tmp: str, name: str) -> str:
    return os.path.join(tmp, name)


def failures(tmp: str, spec: str) -> dict[str, Any]:
    """A save failing on rank 1 partway, then a good one that loads exactly; damaged and foreign checkpoints."""
    wm = wrapkit.adapt(build(spec, seed=3))
    opt, sched = _optimizer(wm, 1e-2, 1)
    _steps(wm, opt, sched, 0)
    user_opt = None if wm.backend == "deepspeed" else opt
    target = _shared_dir(tmp, f"state-{spec}")
    wm.save_state(target, user_opt, scheduler=sched)
    before = _files(target) if dist.get_rank() == 0 else {}
    out: dict[str, Any] = {}
    with _writes_refused(dist.get_rank() == 1):
        out["failed_save"] = _error(lambda: wm.save_state(target, user_opt, scheduler=sched))
    dist.barrier()
    out["left_behind"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tmp, ".*wrapkit-tmp*")))
    out["previous_untouched"] = _files(target) == before if dist.get_rank() == 0 else True
    dist.barrier()  # the next save's temporary directory is not this one's
    # After the failed save: a save that succeeds, and loads back exactly after more steps.
    wm.save_state(target, user_opt, scheduler=sched)
    saved = {k: v.clone() for k, v in wm.full_state_dict(rank0_only=False).items()}
    _steps(wm, opt, sched, 2)
    wm.load_state(target, user_opt, scheduler=sched)
    now = wm.full_state_dict(rank0_only=False)
    out["reloaded_exactly"] = all(torch.equal(now[k], saved[k]) for k in saved)

    # A data file damaged in place (same size): torch's reader fails on every rank; typed.
    damaged = _shared_dir(tmp, f"damaged-{spec}")
    wm.save_state(damaged, user_opt, scheduler=sched)
    if dist.get_rank() == 0:
        data = sorted(f for f in os.listdir(damaged) if f.endswith(".distcp"))[0]
        path = os.path.join(damaged, data)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(b"\x00" * size)
    dist.barrier()
    out["damaged"] = _error(lambda: wm.load_state(damaged, user_opt, scheduler=sched))

    # The optimizer's param groups taken out of the checkpoint's metadata: named, before anything is read.
    if user_opt is not None:
        cut = _shared_dir(tmp, f"cut-{spec}")
        wm.save_state(cut, user_opt, scheduler=sched)
        if dist.get_rank() == 0:
            meta_path = os.path.join(cut, ".metadata")
            with open(meta_path, "rb") as f:
                meta = pickle.load(f)
            del meta.state_dict_metadata["optim/param_groups"]
            with open(meta_path, "wb") as f:
                pickle.dump(meta, f)
            manifest_path = os.path.join(cut, "wrapkit_state.json")
            with open(manifest_path) as f:
                manifest = json.load(f)
            manifest["files"][".metadata"] = os.path.getsize(meta_path)
            with open(manifest_path, "w") as f:
                json.dump(manifest, f)
        dist.barrier()
        out["cut"] = _error(lambda: wm.load_state(cut, user_opt, scheduler=sched))

    # torch's own DCP checkpoint, as another tool writes it.
    foreign = _shared_dir(tmp, f"foreign-{spec}")
    from torch.distributed.checkpoint import save

    save({"weights": torch.ones(4)}, checkpoint_id=foreign)
    out["foreign"] = _error(lambda: wm.load_state(foreign, user_opt))
    return out


def containers(tmp: str, spec: str) -> dict[str, Any]:
    """Optimizers inside containers saved and loaded as the optimizers that hold the state; an optimizer over
    another model refused at save."""
    wm = wrapkit.adapt(build(spec, seed=4))
    out: dict[str, Any] = {}
    if wm.backend == "deepspeed":
        engine_opt, sched = _optimizer(wm, 1e-2, 1)
        _steps(wm, engine_opt, sched, 0)
        # The engine's optimizer handed in inside a wrapper: read as the engine's own.
        wm.save_state(_shared_dir(tmp, f"container-{spec}"), Wrapper(engine_opt))
        out["saved_through_container"] = True
        return out
    named = [(n, p) for n, p in wm.module.named_parameters() if p.requires_grad]
    norms = [p for n, p in named if "norm" in n]
    rest = [p for n, p in named if "norm" not in n]
    # Two optimizers (as a trainer keeps one per model part), in one container. Under FSDP1 every parameter of a
    # unit is one flat parameter: one optimizer then.
    parts = [rest, norms] if norms and rest else [rest or norms]
    opt = Container([torch.optim.AdamW(ps, lr=1e-2) for ps in parts])
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizers[0], lambda s: 1.0)
    _steps(wm, opt, sched, 0)
    directory = _shared_dir(tmp, f"container-{spec}")
    wm.save_state(directory, opt)
    with open(os.path.join(directory, "wrapkit_state.json")) as f:
        manifest = json.load(f)
    out["state_keys"] = sum(len(v) for v in manifest["optimizer"]["state"].values())
    saved_moments = _moments(opt)
    saved_weights = {k: v.clone() for k, v in wm.full_state_dict(rank0_only=False).items()}
    _steps(wm, opt, sched, 2)
    wm.load_state(directory, opt)
    out["moments_restored"] = _same(_moments(opt), saved_moments)
    now = wm.full_state_dict(rank0_only=False)
    out["weights_restored"] = all(torch.equal(now[k], saved_weights[k]) for k in saved_weights)
    # The same state loads into the bare optimizers too (the container is only a container).
    bare = _shared_dir(tmp, f"bare-{spec}")
    if len(opt.optimizers) == 1:
        wm.save_state(bare, opt.optimizers[0])
        with open(os.path.join(bare, "wrapkit_state.json")) as f:
            out["bare_state_keys"] = sum(len(v) for v in json.load(f)["optimizer"]["state"].values())
    # An optimizer over another model's parameters: refused, nothing written.
    other = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    elsewhere = _shared_dir(tmp, f"elsewhere-{spec}")
    out["elsewhere"] = _error(lambda: wm.save_state(elsewhere, other))
    out["elsewhere_written"] = os.path.exists(elsewhere)
    return out


def each(tmp: str, specs: list[str], which: str) -> dict[str, Any]:
    scenario = {"failures": failures, "containers": containers}[which]
    return {spec: scenario(tmp, spec) for spec in specs}
