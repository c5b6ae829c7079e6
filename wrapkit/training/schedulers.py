"""A learning-rate scheduler's state resumed into an optimizer whose param groups come in another order.

``load_state`` matches the optimizer's groups to the saved ones by the names of their parameters, but a
scheduler keeps one entry per group *by position* (``base_lrs``, ``_last_lr``, ...): restored as saved, each
group would run on another group's schedule from the next ``scheduler.step()`` on, with nothing raised. The
per-group lists of every scheduler torch ships are put in the optimizer's order here; a list of a scheduler
not known here that is as long as the groups could be per-group too, and is refused when the order changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["group_order", "PER_GROUP", "unmappable", "reordered", "retyped"]

# The per-group lists in the states of torch's schedulers: LambdaLR / MultiplicativeLR (lr_lambdas), CyclicLR
# (max_lrs, base_momentums, max_momentums), ReduceLROnPlateau (min_lrs), and every LRScheduler's base_lrs and
# _last_lr. SequentialLR and ChainedScheduler keep their children's states in ``_schedulers``.
PER_GROUP = frozenset({"base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "base_momentums", "max_momentums",
                       "min_lrs"})
_CHILDREN = "_schedulers"
# The lists torch's schedulers keep that are not per group, whatever their length: OneCycleLR's phases,
# SequentialLR's milestones.
_NOT_PER_GROUP = frozenset({"_schedule_phases", "_milestones"})


def group_order(saved: Sequence[Sequence[str]], current: Sequence[Sequence[str]]) -> list[int] | None:
    """For each current group, the index of the saved group holding the same parameters; None where the groups do
    not pair off one to one (then the positions are kept, as before)."""
    by_names = {tuple(sorted(names)): i for i, names in enumerate(saved)}
    order = [by_names.get(tuple(sorted(names)), -1) for names in current]
    if len(saved) != len(current) or sorted(order) != list(range(len(saved))):
        return None
    return order


def unmappable(state: Mapping[str, Any], groups: int, where: str = "") -> list[str]:
    """Lists in a scheduler's ``state`` that are as long as the optimizer's groups but not known to be per-group."""
    out: list[str] = []
    for key, value in state.items():
        if key == _CHILDREN and isinstance(value, list):
            for i, child in enumerate(value):
                if isinstance(child, Mapping):
                    out += unmappable(child, groups, f"{where}{key}[{i}].")
        elif key not in PER_GROUP | _NOT_PER_GROUP and isinstance(value, (list, tuple)) and len(value) == groups:
            out.append(f"{where}{key}")
    return out


def reordered(state: Mapping[str, Any], order: list[int]) -> dict[str, Any]:
    """``state`` with every per-group list in the current groups' order (``order[i]``: the saved index of group i)."""
    out = dict(state)
    for key, value in state.items():
        if key == _CHILDREN and isinstance(value, list):
            out[key] = [reordered(c, order) if isinstance(c, Mapping) else c for c in value]
        elif key in PER_GROUP and isinstance(value, (list, tuple)) and len(value) == len(order):
            out[key] = type(value)(value[i] for i in order)
    return out


def retyped(saved: Any, like: Any) -> Any:
    """``saved`` (a state read back from the checkpoint) with the keys and mapping classes of ``like`` (the
    scheduler's own state now). DCP flattens nested mappings into paths of strings, so ``MultiStepLR``'s
    ``milestones`` (a ``Counter`` of step numbers) came back keyed by ``"3"``: no step ever matched it, and the
    rate never fell again."""
    if isinstance(saved, Mapping) and isinstance(like, Mapping):
        keys = {str(k): k for k in like}
        out: dict[Any, Any] = {}
        for k, v in saved.items():
            key = keys.get(str(k), k)
            out[key] = retyped(v, like.get(key))
        cls: Any = type(like)
        try:
            return cls(out)
        except TypeError:  # a mapping class that is not built from a dict: a plain one
            return out
    if isinstance(saved, list) and isinstance(like, list) and len(saved) == len(like):
        return [retyped(a, b) for a, b in zip(saved, like, strict=True)]
    return saved
