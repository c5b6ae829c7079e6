"""Agreement across ranks: every check that could fail on one rank only is decided together.

A collective must be entered by every rank of the group or by none. So whatever may differ
between ranks (a failed write on rank 0, a bad argument on one rank, a body that raised) is
OR-ed over the group in one small all-reduce first, and every rank then takes the same branch:
all go on, or all raise the same error. Models that are not distributed (plain, DataParallel)
never vote, even inside a distributed job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._errors import DistributedStateError, StateDictError

if TYPE_CHECKING:
    from .adapters._base import Adapter

__all__ = [
    "is_distributed", "agree_flags", "agree_any", "settle", "check_modifier_rank",
    "models_group", "agree_over_models", "any_over_models", "raise_agreed", "first_replica", "broadcast_object",
]


def is_distributed(world_size: int | None, group: Any = None) -> bool:
    # Prefer the adapter's world size to the group's: a plain model in a distributed
    # job has no group of its own (its group is None, which dist would read as WORLD).
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return (world_size if world_size is not None else dist.get_world_size(group)) > 1


def _flag_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)) if group is not None else str(dist.get_backend())
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _max_over(t: torch.Tensor, group: Any, replicas: Sequence[Any]) -> None:
    """All-reduce MAX over ``group``, then over each replica group: the maximum over every rank
    that holds a copy of the model (a 2-D layout's rows, then its columns)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    for replica_group in replicas:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=replica_group)


def agree_flags(flags: Sequence[bool], group: Any, world_size: int | None = None,
                replicas: Sequence[Any] = ()) -> list[bool]:
    """Each flag OR-ed over the ranks of ``group`` (and of ``replicas``), all in one all-reduce per group."""
    if not is_distributed(world_size, group):
        return list(flags)
    t = torch.tensor([int(f) for f in flags], device=_flag_device(group))
    _max_over(t, group, replicas)
    return [bool(x) for x in t.tolist()]


def agree_any(flag: bool, group: Any, world_size: int | None = None, replicas: Sequence[Any] = ()) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group`` (one all-reduce)."""
    return agree_flags([flag], group, world_size, replicas)[0]


@contextlib.contextmanager
def settle(on_exit: Callable[[bool], None], agree: bool, group: Any, world_size: int,
           replicas: Sequence[Any] = ()) -> Iterator[None]:
    """Run the body, then ``on_exit(failed)``, exception or not.

    ``failed`` says whether the body raised; with ``agree`` it says whether it raised on
    any rank, which costs one collective that every rank enters (so a write-back is done
    everywhere or nowhere). ``replicas``: the groups across copies of a replicated, sharded
    model (HSDP), whose write-back crosses them too."""
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        if agree:
            failed = agree_any(failed, group, world_size, replicas)
        on_exit(failed)


def check_modifier_rank(modifier_rank: int | None, world_size: int, group: Any,
                        replicas: Sequence[Any] = (), flags: Sequence[bool] = ()) -> list[bool]:
    """Refuse, on every rank alike, a ``modifier_rank`` that is out of range or differs across ranks.

    ``flags`` ride along in the same collective: returned OR-ed over the ranks."""
    bad = modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world_size)
    value = -1 if modifier_rank is None or bad else int(modifier_rank)
    agreed = [bool(f) for f in flags]
    if is_distributed(world_size):
        # [any bad, max value, -min value, *flags] in one collective, before any other collective starts.
        t = torch.tensor([int(bad), value, -value, *map(int, agreed)], device=_flag_device(group))
        _max_over(t, group, replicas)
        values = [int(x) for x in t.tolist()]
        any_bad, differs = bool(values[0]), values[1] != -values[2]
        agreed = [bool(x) for x in values[3:]]
    else:
        any_bad, differs = bad, False
    if any_bad:
        raise DistributedStateError(
            f"modifier_rank={modifier_rank!r} (on at least one rank) is not a rank of this group of {world_size}; "
            f"pass None (writes discarded) or a rank in 0..{world_size - 1}, the same on every rank."
        )
    if differs:
        raise DistributedStateError(
            f"modifier_rank differs across ranks (this rank passed {modifier_rank!r}); every rank must pass the "
            "same value, since the rank whose writes are kept is decided collectively."
        )
    return agreed


# -- agreement over the group of one or more models -----------------------------------
def models_group(*wms: Adapter) -> tuple[bool, Any]:
    """Whether a collective is needed for these models, and over which group.

    Non-distributed backends (plain, DataParallel) never enter a collective: a user may
    save a plain model from rank 0 alone while a process group exists.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    for wm in wms:
        if wm.distributed:
            return True, wm.process_group()
    return False, None


def agree_over_models(flags: list[bool], *wms: Adapter) -> list[bool]:
    """Each flag OR-ed over the group of ``wms`` and across its replicas (HSDP), in one
    collective per group (the flags themselves when no collective applies)."""
    use, group = models_group(*wms)
    if not use:
        return list(flags)
    return agree_flags(flags, group, replicas=_replicas_of(*wms))


def _replicas_of(*wms: Adapter) -> list[Any]:
    """The replica groups (HSDP) of the model whose group ``models_group`` chose."""
    return next((wm.replica_groups() for wm in wms if wm.distributed), [])


def first_replica(wm: Adapter) -> bool:
    """Whether this rank belongs to the first copy of a model replicated across groups (HSDP):
    the copy whose rank 0 writes files for all of them. True without replicas."""
    return all(dist.get_rank(group) == 0 for group in wm.replica_groups())


def any_over_models(flag: bool, *wms: Adapter) -> bool:
    """``flag`` OR-ed over the group of ``wms`` (just ``flag`` when no collective applies)."""
    return agree_over_models([flag], *wms)[0]


def raise_agreed(problems: list[str], what: str, fix: str, *wms: Adapter, agreed: bool | None = None) -> None:
    """Raise on every rank if any rank found a problem; the local list when there is one.

    ``agreed``: the OR of ``bool(problems)`` over the ranks, when the caller already has it."""
    if not (any_over_models(bool(problems), *wms) if agreed is None else agreed):
        return
    use, group = models_group(*wms)
    if use:
        # Every rank reports every rank's problems (they are usually the same list).
        lists: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, problems, group=group)
        if all(x == lists[0] for x in lists):
            problems = list(lists[0])
        else:
            problems = [f"rank {r}: {p}" for r, lst in enumerate(lists) for p in lst]
        # And from every copy of the model (HSDP): a problem found by one replica's writer is told to all.
        for replica_group in _replicas_of(*wms):
            lists = [None] * dist.get_world_size(replica_group)
            dist.all_gather_object(lists, problems, group=replica_group)
            problems = list(dict.fromkeys(p for lst in lists for p in lst))
    listing = "\n  ".join(problems)
    raise StateDictError(f"{what}: {len(problems)} problem(s), nothing was written:\n  {listing}\n{fix}")


def broadcast_object(value: Any, src: int, group: Any) -> Any:
    """``value`` as group rank ``src`` has it, on every rank of ``group`` (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return box[0]
