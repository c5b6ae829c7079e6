"""What reading a torch distributed checkpoint needs, for wrapkit's own (``state.py``) and other trainers'
(``foreign.py``): the group DCP runs over, objects carried through it, its warnings and its failure type."""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .._agree import any_over_models, models_group, span
from .._errors import StateDictError

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["Object", "dcp_group", "quiet", "checkpoint_exception", "read"]


class Object:
    """One picklable value in the checkpoint. DCP hands a load a copy of the dict it is given and gives back
    only through ``load_state_dict`` (its ``Stateful`` protocol), so every object travels in one of these."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def dcp_group(wm: Adapter, problems: list[str]) -> tuple[bool, Any]:
    """(Whether DCP runs without collectives, the group it runs over): every rank holding the model."""
    use, group = models_group(wm)
    if not use:
        return True, None
    held_by = span(wm)
    if held_by == dist.get_world_size():
        return False, None
    if wm.outer_groups():
        problems.append(f"the model lies over {held_by} of the job's {dist.get_world_size()} ranks in more than one "
                        "group; save_state and load_state serve a model over every rank, or over one group")
    return False, group


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    # DCP warns that it runs in one process whenever it is told to (no_dist): a model with no group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was after). DCP's plans and metadata are
    thousands of small objects at once, enough to start a full collection of the whole heap, which in a trainer
    (transformers, DeepSpeed, the model) took 50-75 ms, a quarter of a save; they are freed by reference counting
    when the save ends, so no collection is owed afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def checkpoint_exception() -> type[BaseException]:
    """torch's distributed checkpoint reports a failure on any rank as ``CheckpointException`` on every rank; it
    derives from ``BaseException``, so ``except Exception`` (a trainer's included) lets it through."""
    from torch.distributed.checkpoint.api import CheckpointException

    exc: type[BaseException] = CheckpointException
    return exc


def read(wm: Adapter, directory: str, parts: list[tuple[dict[str, Any], str, Any]], no_dist: bool, group: Any,
         fix: str) -> None:
    """DCP's load of each ``(state, path, metadata)`` (the metadata already read and checked), collective; a
    failure on any rank raises ``StateDictError`` on every rank."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .manifest import reader_class

    failure: BaseException | None = None
    try:
        with quiet():
            for state, path, metadata in parts:
                state_dict_loader.load(state, storage_reader=reader_class()(path, metadata), process_group=group,
                                       no_dist=no_dist, planner=DefaultLoadPlanner(flatten_state_dict=False,
                                                                                   flatten_sharded_tensors=False))
    except (Exception, checkpoint_exception()) as exc:
        failure = exc
    if any_over_models(failure is not None, wm):
        cause = f"{type(failure).__name__}: {failure}" if failure is not None else "see the other ranks' errors"
        raise StateDictError(f"load_state from {directory!r} failed while reading ({cause}); the weights and the "
                             "optimizer state may be partly loaded. " + fix) from failure
