"""Who still refers to an object: the chain from a module global down to it, for the worker's leak guard.

``gc.get_referrers`` alone does not answer this for a process group: the containers that hold one are often
untracked by the collector (a tuple or dict of objects it does not track, such as a cache key), and anything
alive when the worker last settled is frozen out of the collected generations. So one reverse index is built
over every object, untracked containers included, and walked up from the object to the modules."""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

__all__ = ["holder_chains"]

_CONTAINERS = {tuple, list, dict, set, frozenset}  # by exact type: isinstance would read __class__ off
# deprecated objects and warn


def holder_chains(target: Any, limit: int = 2) -> list[str]:
    """Up to ``limit`` shortest chains, each ``module.global -> Type -> ... -> Type(target)``, or one line saying
    no module reaches it. Seconds of work: only for a guard that failed."""
    gc.unfreeze()  # frozen objects are invisible to the collector's queries
    try:
        return _chains(target, limit)
    finally:
        gc.freeze()


def _chains(target: Any, limit: int) -> list[str]:
    holders: dict[int, list[Any]] = {}

    def index(obj: Any, depth: int) -> None:
        for ref in gc.get_referents(obj):
            holders.setdefault(id(ref), []).append(obj)
            if depth and type(ref) in _CONTAINERS and not gc.is_tracked(ref):
                index(ref, depth - 1)

    for obj in gc.get_objects():
        if type(obj) is not types.FrameType:  # our own frames hold the target on the way
            index(obj, 3)
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if hasattr(m, "__dict__")}
    below: dict[int, Any] = {id(target): None}  # each object reached -> the one it refers to, toward the target
    frontier: list[Any] = [target]
    found: list[str] = []
    while frontier and len(found) < limit:
        step: list[Any] = []
        for obj in frontier:
            for holder in holders.get(id(obj), []):
                if id(holder) in modules:
                    keys = [k for k, v in holder.items() if v is obj]
                    found.append(f"{modules[id(holder)]}.{keys[0] if keys else '?'}" + _down(obj, below))
                elif id(holder) not in below:
                    below[id(holder)] = obj
                    step.append(holder)
        frontier = step
    return found[:limit] or ["nothing a module reaches (native state, or a cycle through it)"]


def _down(obj: Any, below: dict[int, Any]) -> str:
    names: list[str] = []
    while obj is not None and len(names) < 12:
        names.append(type(obj).__qualname__)
        obj = below.get(id(obj))
    return "".join(f" -> {n}" for n in names)
