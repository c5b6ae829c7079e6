"""Agreement across ranks: every check that could fail on one rank only is decided together.

A collective must be entered by every rank of the group or by none. So whatever may differ
between ranks (a failed write on rank 0, a bad argument on one rank, a body that raised) is
OR-ed over the group in one small all-reduce first, and every rank then takes the same branch:
all go on, or all raise the same error. Models that are not distributed (plain, DataParallel)
never vote, even inside a distributed job.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ._errors import DistributedStateError, Listed, StateDictError

__all__ = [
    "Ranks", "Call", "enter", "CHECK_ENV", "checking", "is_distributed", "agree_flags", "settle",
    "check_modifier_rank",
    "models_group", "agree_over_models", "any_over_models", "raise_agreed", "first_replica", "writes_files",
    "broadcast_object",
]


class Ranks(Protocol):
    """What an agreement needs of a model, and all it reads: whether it votes at all (a model that is not
    distributed never does, even inside a distributed job), its group and this rank's place in it, and
    the groups around it (HSDP's replicas, pipeline stages beside another backend). Every backend's adapter is one."""

    @property
    def distributed(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def process_group(self) -> Any: ...

    def outer_groups(self) -> list[Any]: ...


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
            [failed] = agree_flags([failed], group, world_size, replicas)
        on_exit(failed)


def check_modifier_rank(op: str, modifier_rank: int | None, wm: Ranks, flags: Sequence[bool] = ()) -> list[bool]:
    """``enter`` for operation ``op``, which takes a ``modifier_rank``: refuse, on every rank alike, one
    that is not a rank of the group (a value that differs across ranks is a mismatched call).

    ``flags`` ride along in the same collective: returned OR-ed over the ranks."""
    world_size = wm.world_size
    bad = modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world_size)
    any_bad, *agreed = enter(Call.of(op, modifier_rank=modifier_rank), wm, flags=[bad, *flags], invalid=1)
    if any_bad:
        raise DistributedStateError(
            f"modifier_rank={modifier_rank!r} (on at least one rank) is not a rank of this group of {world_size}; "
            f"pass None (writes discarded) or a rank in 0..{world_size - 1}, the same on every rank."
        )
    return agreed


# -- the entry of every operation ------------------------------------------------------
CHECK_ENV = "WRAPKIT_CHECK_CALLS"
_SLOTS = 6  # flags an entry can carry; the entry tensor has one size for every operation


@dataclass(frozen=True)
class Call:
    """One wrapkit operation as a rank called it: its name and the arguments that must be the
    same on every rank."""

    op: str
    args: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, op: str, **args: Any) -> Call:
        return cls(op, tuple(args.items()))

    def __str__(self) -> str:
        return f"{self.op}({', '.join(f'{k}={v!r}' for k, v in self.args)})"

    def fingerprints(self) -> tuple[int, int]:
        """Of the operation, and of the operation with its arguments."""
        return _hash(self.op), _hash(str(self))


def _hash(text: str) -> int:
    # 62 bits: the value and its negation both fit an int64, for the one MAX all-reduce.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def checking() -> bool:
    """Whether calls are checked (``WRAPKIT_CHECK_CALLS`` is not 0)."""
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def enter(call: Call, *wms: Ranks, flags: Sequence[bool] = (), invalid: int = 0) -> list[bool]:
    """The first collective of every collective operation: every rank says which operation it
    entered, and with which arguments, in one small all-reduce over the group of ``wms`` (and
    across the replicas of an HSDP model) that also ORs ``flags`` (returned, agreed).

    Every operation's entry has the same size, so ranks that called *different* operations meet
    here rather than in mismatched gathers that would wait for the process-group timeout:
    ``DistributedStateError`` on every rank, naming each rank's call, before anything changed.
    With ``WRAPKIT_CHECK_CALLS=0`` an operation with no flags to agree skips its entry (the call
    is then not checked); one that agrees flags anyway still carries the check, at no cost.

    The first ``invalid`` flags say that an argument is not valid on some rank: when one is set,
    the mismatch is not raised, so that the caller raises its own error naming the fix.
    """
    agreed = [bool(f) for f in flags]
    assert len(agreed) <= _SLOTS, call.op
    use, group = models_group(*wms)
    if not use or (not agreed and not checking()):
        return agreed
    op, full = call.fingerprints()
    # [op, -op, op and arguments, -(op and arguments), flags...]: after MAX, a fingerprint and
    # its negation's negation differ exactly when the ranks disagree on it.
    t = torch.zeros(4 + _SLOTS, dtype=torch.int64, device=_flag_device(group))
    t[:4] = torch.tensor([op, -op, full, -full], dtype=torch.int64)
    t[4:4 + len(agreed)] = torch.tensor(agreed, dtype=torch.int64)
    replicas = _replicas_of(*wms)
    _meet(t, group, replicas, call)
    values = t.tolist()
    agreed = [bool(x) for x in values[4:4 + len(agreed)]]
    same_op, same_args = values[0] == -values[1], values[2] == -values[3]
    # One operation everywhere with an argument invalid somewhere: the operation's own error
    # (every rank takes the same path after it). Different operations: never.
    if not same_op or (not same_args and not any(agreed[:invalid])):
        _raise_mismatch(call, group, replicas)
    return agreed


ENTRY_TIMEOUT_ENV = "WRAPKIT_ENTRY_TIMEOUT"
DEFAULT_ENTRY_TIMEOUT_S = 600.0


def entry_timeout() -> float | None:
    """Seconds an operation's entry waits for the other ranks (``WRAPKIT_ENTRY_TIMEOUT``; 0 or
    less: as long as the process group's own timeout)."""
    raw = os.environ.get(ENTRY_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_ENTRY_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        raise DistributedStateError(f"{ENTRY_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 600, "
                                    "or 0 to wait as long as the process group's own timeout") from None
    return seconds if seconds > 0 else None


def _meet(t: torch.Tensor, group: Any, replicas: Sequence[Any], call: Call) -> None:
    """``_max_over`` for an operation's entry, where a rank that never comes is the likely bug (an
    operation called on some ranks only): wait at most ``entry_timeout()``, then say which call
    was left waiting, instead of the process group's timeout (30 minutes on gloo) and a bare
    "Timed out waiting ... for recv"."""
    import datetime

    timeout = entry_timeout()
    for g in [group, *replicas]:
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=True)
        if timeout is None:
            work.wait()
            continue
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:  # gloo raises when the time is up
            done, cause = False, f" ({_first_line(exc)})"
        else:
            cause = ""
        if done is False:
            size = dist.get_world_size(g)
            raise DistributedStateError(
                f"{call} was entered on global rank {dist.get_rank()}, and not every rank of its group of {size} "
                f"joined it within {timeout:g} s ({ENTRY_TIMEOUT_ENV}){cause}. Every rank must make the same "
                "collective wrapkit calls in the same order: look for a call made on some ranks only (under "
                "`if rank == 0:`, or after an exception on another rank). The process group cannot be used "
                "after this; end the job."
            )


def _first_line(exc: BaseException) -> str:
    return next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)[:200]


def _raise_mismatch(call: Call, group: Any, replicas: Sequence[Any]) -> None:
    """Every rank learns every rank's call (all saw the mismatch in the same all-reduce)."""
    calls: list[tuple[int, str]] = [(dist.get_rank(), str(call))]
    for g in [group, *replicas]:
        lists: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(lists, calls, group=g)
        calls = sorted(dict.fromkeys(c for lst in lists for c in lst))
    listing = "\n  ".join(f"rank {r}: {c}" for r, c in calls)
    raise DistributedStateError(
        f"the ranks of this group called different wrapkit operations, or the same one with different "
        f"arguments, at the same point:\n  {listing}\nEvery rank must make the same collective calls in "
        "the same order with the same arguments; nothing was changed by this call."
    )


# -- agreement over the group of one or more models -----------------------------------
def models_group(*wms: Ranks) -> tuple[bool, Any]:
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


def agree_over_models(flags: list[bool], *wms: Ranks) -> list[bool]:
    """Each flag OR-ed over the group of ``wms`` and across its replicas (HSDP), in one
    collective per group (the flags themselves when no collective applies)."""
    use, group = models_group(*wms)
    if not use:
        return list(flags)
    return agree_flags(flags, group, replicas=_replicas_of(*wms))


def _replicas_of(*wms: Ranks) -> list[Any]:
    """The replica groups (HSDP) of the model whose group ``models_group`` chose."""
    return next((wm.outer_groups() for wm in wms if wm.distributed), [])


def span(wm: Ranks) -> int:
    """How many ranks hold a distributed model: its group's, times each group around it (HSDP's replicas,
    pipeline stages beside another backend)."""
    n = wm.world_size
    for g in wm.outer_groups():
        n *= dist.get_world_size(g)
    return n


def first_replica(wm: Ranks) -> bool:
    """Whether this rank belongs to the first copy of a model replicated across groups (HSDP):
    the copy whose rank 0 writes files for all of them. True without replicas."""
    return all(dist.get_rank(group) == 0 for group in wm.outer_groups())


def writes_files(wm: Ranks) -> bool:
    """Whether this rank writes a model's files: rank 0 of its first copy, one writer however many
    replicas there are."""
    return wm.rank == 0 and first_replica(wm)


def any_over_models(flag: bool, *wms: Ranks) -> bool:
    """``flag`` OR-ed over the group of ``wms`` (just ``flag`` when no collective applies)."""
    return agree_over_models([flag], *wms)[0]


def raise_agreed(problems: list[str], what: str, fix: str, *wms: Ranks, agreed: bool | None = None) -> None:
    """Raise on every rank if any rank found a problem; the local list when there is one.

    ``StateDictError`` ending with ``fix``, which is added only for problems that do not carry their own: another
    error listed among them (``Listed``) says its own fix, and where all are of one such type it is raised.
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
            problems = [_prefixed(p, f"rank {r}: ") for r, lst in enumerate(lists) for p in lst]
        # And from every copy of the model (HSDP): a problem found by one replica's writer is told to all.
        for replica_group in _replicas_of(*wms):
            lists = [None] * dist.get_world_size(replica_group)
            dist.all_gather_object(lists, problems, group=replica_group)
            problems = list(dict.fromkeys(p for lst in lists for p in lst))
    listing = "\n  ".join(problems)
    own = {p.error for p in problems if isinstance(p, Listed)}
    plain = any(not isinstance(p, Listed) for p in problems)
    error: type[Exception] = own.pop() if len(own) == 1 and not plain else StateDictError
    hint = f"\n{fix}" if plain else ""
    raise error(f"{what}: {len(problems)} problem(s), nothing was written:\n  {listing}{hint}")


def _prefixed(problem: str, prefix: str) -> str:
    return problem.prefixed(prefix) if isinstance(problem, Listed) else prefix + problem


def broadcast_object(value: Any, src: int, group: Any) -> Any:
    """``value`` as group rank ``src`` has it, on every rank of ``group`` (any picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return box[0]
