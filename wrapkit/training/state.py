"""Training state that resumes on any backend and world size: ``save_state`` / ``load_state``.

The format is torch's distributed checkpoint (DCP), written with every tensor under its canonical name and
its full shape, each rank writing the boxes it holds (``formats.dcp.Blocks``: a range of the flattened
tensor, a block of rows or columns, or all of it) and reading on a load only what overlaps its own. So the
state saved by one layout loads into any other: DCP does the overlap arithmetic, and no rank holds more
than its share plus one box. The keys:

- ``model/<name>``: the parameter as the optimizer steps it (its fp32 master where the backend keeps one);
- ``optim/<name>/<key>``: the optimizer's state for it: each per-element tensor (Adam's ``exp_avg``,
  ``exp_avg_sq``) in boxes like the parameter's, anything else (``step``) whole;
- ``optim/param_groups``: each group's hyperparameters (the groups are matched by their parameters' names,
  kept in the manifest); ``scheduler``; ``extra``; ``rng/<global rank>``: that rank's RNG states.

Beside DCP's files, ``wrapkit_state.json`` (the manifest) says what was saved and from what: the backend,
topology, world size, versions, every parameter's name and shape, the optimizer's class and groups, and
every file's size, so that a load checks all of it before anything changes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._agree import Call, any_over_models, enter, raise_agreed, writes_files
from .._errors import ArgumentError, StateDictError
from .._results import StateLoad
from ..formats.directory import commit_directory, open_directory
from .held import Holding, hyper, put_scalar, scalars, state_tensors, unplaced
from .held import specs as held_specs
from .manifest import (
    FORMAT,
    MANIFEST,
    class_name,
    compare_optimizer,
    compare_others,
    compare_parameters,
    read_manifest,
    saved_keys,
    versions,
)
from .reading import Object, checkpoint_exception, collector_paused, dcp_group, read
from .schedulers import group_order, reordered, retyped, unmappable
from .writing import write

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["StateLoad", "save_state", "load_state", "MANIFEST", "FORMAT"]

_FIX_SAVE = "Pass a directory whose parent exists and is writable, and the optimizer the model trains with."
_FIX_LOAD = ("Pass the directory save_state wrote, with an optimizer (and scheduler) built as when it was saved, "
             "over this model.")


def _rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_optimizer(optimizer: Any, where: str) -> None:
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
        raise ArgumentError(f"{where}(optimizer=...) takes a torch optimizer (with param_groups and state), got "
                            f"{type(optimizer).__name__}")


def _check_scheduler(scheduler: Any, where: str) -> None:
    if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise ArgumentError(f"{where}(scheduler=...) takes an object with state_dict() and load_state_dict() (a "
                            f"torch LR scheduler), got {type(scheduler).__name__}")


# -- save ---------------------------------------------------------------------------------------------------
def save_state(wm: Adapter, directory: str, optimizer: Any = None, scheduler: Any = None,
               extra: Mapping[str, Any] | None = None) -> None:
    """See ``WrappedModel.save_state``."""
    with collector_paused():
        _save_state(wm, directory, optimizer, scheduler, extra)


def _save_state(wm: Adapter, directory: str, optimizer: Any, scheduler: Any, extra: Mapping[str, Any] | None) -> None:
    _check_optimizer(optimizer, "save_state")
    _check_scheduler(scheduler, "save_state")
    if extra is not None and not isinstance(extra, Mapping):
        raise ArgumentError(f"save_state(extra=...) takes a dict, got {type(extra).__name__}")
    problems: list[str] = []
    source = Holding(wm, optimizer, "save_state", problems)
    optimizer = source.optimizer
    no_dist, group = dcp_group(wm, problems)
    call = Call.of("save_state", optimizer=type(optimizer).__name__ if optimizer is not None else None,
                   scheduler=scheduler is not None, extra=extra is not None)
    directory, tmp = open_directory(wm, directory, call, problems, _FIX_SAVE)
    if any_over_models(not os.path.isdir(tmp), wm):
        if writes_files(wm):
            shutil.rmtree(tmp, ignore_errors=True)
        raise StateDictError(f"save_state to {directory!r}: every rank writes its own part, but some rank cannot see "
                             f"the directory {tmp!r} made beside it; save to storage every rank shares")
    writer = writes_files(wm)
    with torch.no_grad():
        held = source.held()
        state: dict[str, Any] = dict(state_tensors(held))
        if optimizer is not None:
            state[f"optim/scalars/{_global_rank()}"] = Object(scalars(held))
        if writer and optimizer is not None:
            state["optim/param_groups"] = Object(hyper(optimizer))
        if writer and scheduler is not None:
            state["scheduler"] = Object(scheduler.state_dict())
        if writer and extra is not None:
            state["extra"] = Object(dict(extra))
        state[f"rng/{_global_rank()}"] = Object(_rng())
    error: BaseException | None = None
    try:
        # DCP's files, written back to disk as they are written (formats/writeback.py) and fsynced, before the
        # directory is renamed in; in fewer rounds between the ranks than DCP's own save (writing.py).
        error = write(state, tmp, group, no_dist)
    except (Exception, checkpoint_exception()) as exc:  # every rank learns of it in commit_directory
        error = exc
    # Which state keys each parameter has, from every rank (a rank holds some parameters only): a load checks and
    # creates them from the manifest alone.
    specs = held_specs(held) if optimizer is not None else {}
    if not no_dist and optimizer is not None:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, specs, group=group)
        for other in every:
            for name, spec in other.items():
                specs.setdefault(name, {}).update(spec)
    manifest = {
        "format": FORMAT, "backend": wm.backend, "stack": list(wm.stack), "world_size": wm.world_size,
        "ranks": dist.get_world_size() if not no_dist else 1, "topology": wm.describe(),
        "versions": versions(wm), "parameters": {n: list(s) for n, s in wm.weights.param_shapes().items()},
        "optimizer": None if optimizer is None else {
            "class": class_name(optimizer), "param_groups": source.whole_group_names(), "state": specs},
        "scheduler": None if scheduler is None else class_name(scheduler), "extra": extra is not None,
    }

    def finish(tmp: str) -> None:
        manifest["files"] = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    commit_directory(wm, "save_state", directory, tmp, error, finish)


def _scheduler_order(manifest: Mapping[str, Any] | None, source: Holding, optimizer: Any, scheduler: Any,
                     problems: list[str]) -> list[int] | None:
    """Where the optimizer's groups come in another order than the saved ones: for each group, the saved one it
    matches, so that the scheduler's per-group state follows (``schedulers``); None to keep the positions. A
    scheduler whose per-group state cannot be mapped is a problem (refused before anything changes)."""
    saved = ((manifest or {}).get("optimizer") or {}).get("param_groups")
    if optimizer is None or scheduler is None or not saved:
        return None
    order = group_order(saved, source.group_names())
    if order is None or order == list(range(len(order))):
        return None
    bad = unmappable(scheduler.state_dict(), len(order))
    if bad:
        problems.append(f"the optimizer's param groups come in another order than the saved ones, and the "
                        f"scheduler ({type(scheduler).__name__}) keeps state that wrapkit cannot put in the new order "
                        f"({', '.join(bad)}); build the optimizer's groups in the saved order")
    return order


def load_state(wm: Adapter, directory: str, optimizer: Any = None, scheduler: Any = None) -> StateLoad:
    """See ``WrappedModel.load_state``."""
    with collector_paused():
        return _load_state(wm, directory, optimizer, scheduler)


def _load_state(wm: Adapter, directory: str, optimizer: Any, scheduler: Any) -> StateLoad:

    _check_optimizer(optimizer, "load_state")
    _check_scheduler(scheduler, "load_state")
    directory = os.path.abspath(directory)
    if not os.path.exists(os.path.join(directory, MANIFEST)):  # another trainer's checkpoint, where it is one
        from .foreign import Foreign, load_foreign

        try:
            found = Foreign.of(directory) if os.path.isdir(directory) else None
        except Exception:  # unreadable metadata: reported below as a directory save_state did not complete
            found = None
        if found is not None:
            return load_foreign(wm, directory, found, optimizer, scheduler)
    problems: list[str] = []
    source = Holding(wm, optimizer, "load_state", problems)
    optimizer = source.optimizer
    no_dist, group = dcp_group(wm, problems)
    manifest, metadata = read_manifest(directory, problems)
    keys: dict[str, dict[str, list[Any]]] = {}
    if manifest is not None and metadata is not None:
        keys = saved_keys(manifest)
        compare_parameters(wm, manifest, problems)
        compare_optimizer(source, manifest, keys, problems)
        compare_others(manifest, scheduler, problems)
    order = _scheduler_order(manifest, source, optimizer, scheduler, problems)
    call = Call.of("load_state", optimizer=type(optimizer).__name__ if optimizer is not None else None,
                   scheduler=scheduler is not None)
    [agreed] = enter(call, wm, flags=[bool(problems)], invalid=1)
    raise_agreed(problems, f"load_state from {directory!r}", _FIX_LOAD, wm, agreed=agreed)
    assert manifest is not None and metadata is not None

    saved = metadata.state_dict_metadata
    rank_key = f"rng/{_global_rank()}"
    with torch.no_grad():
        if optimizer is not None:
            source.create(keys)
        held = source.held()
        state: dict[str, Any] = dict(state_tensors(held))
        absent = sorted(k for k in state if k not in saved)
        if optimizer is not None:
            absent += unplaced(held, keys)
        if optimizer is not None and "optim/param_groups" not in saved:
            absent.append("optim/param_groups (saved without an optimizer: pass optimizer=None)")
        # Every rank takes part: one whose layout the checkpoint does not cover raises on all.
        missing = [f"entries missing from the checkpoint ({len(absent)}): {', '.join(absent[:5])}"] if absent else []
        raise_agreed(missing, f"load_state from {directory!r}", _FIX_LOAD, wm)
        scalar_keys = [k for k in saved if k.startswith("optim/scalars/")] if optimizer is not None else []
        for key in scalar_keys:  # each small; every rank reads all (which rank held a parameter is not known)
            state[key] = Object()
        if optimizer is not None:
            state["optim/param_groups"] = Object()
        if scheduler is not None:
            state["scheduler"] = Object()
        if "extra" in saved:
            state["extra"] = Object()
        if rank_key in saved:
            state[rank_key] = Object()
        read(wm, directory, [(state, directory, metadata)], no_dist, group, _FIX_LOAD)
        if optimizer is not None:
            scalars: dict[str, dict[str, Any]] = {}
            for key in scalar_keys:
                scalars.update(state[key].value)
            for h in held:
                for k, value in scalars.get(h.name, {}).items():
                    put_scalar(optimizer, h, k, value)
        source.loaded()

    if optimizer is not None:
        # Each group takes the hyperparameters of the saved group its parameters were in (a pipeline stage's
        # groups hold its own layers of the whole model's).
        saved_groups = manifest["optimizer"]["param_groups"]
        hypers = state["optim/param_groups"].value
        by_names = {tuple(names): i for i, names in enumerate(saved_groups)}
        index = {n: i for i, names in enumerate(saved_groups) for n in names}
        for group_names, g in zip(source.group_names(), optimizer.param_groups, strict=True):
            at = by_names.get(tuple(group_names), index.get(group_names[0]) if group_names else None)
            if at is not None:
                g.update(hypers[at])
    if scheduler is not None:
        value = retyped(state["scheduler"].value, scheduler.state_dict())
        scheduler.load_state_dict(value if order is None else reordered(value, order))
    skipped: list[str] = []
    if rank_key in saved:
        _set_rng(state[rank_key].value)
    else:
        skipped.append(f"RNG states: global rank {_global_rank()} had none in the checkpoint (saved by "
                       f"{manifest.get('ranks')} rank(s)); this rank's are left as they were")
    return StateLoad(dict(state["extra"].value) if "extra" in state else {}, skipped)
