"""The optimizers that hold a training state, inside the containers trainers hand around."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

__all__ = ["Several", "unwrap_optimizer"]


def _is_optimizer(obj: Any) -> bool:
    return hasattr(obj, "param_groups") and hasattr(obj, "state")


def unwrap_optimizer(optimizer: Any, own: Any = None) -> Any:
    """The optimizer that holds the state, inside the containers trainers hand around: a wrapper's ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``, DeepSpeed's wrappers), a container's ``.optimizers`` (torchtitan's
    ``OptimizersContainer``: a torch ``Optimizer`` whose own state stays empty) read as one. ``own``, a backend's
    own optimizer, ends the search where it is met."""
    seen: set[int] = set()
    while id(optimizer) not in seen and optimizer is not own:
        seen.add(id(optimizer))
        several = getattr(optimizer, "optimizers", None)
        if isinstance(several, (list, tuple)) and several and all(_is_optimizer(o) for o in several):
            inner = [unwrap_optimizer(o, own) for o in several]
            return inner[0] if len(inner) == 1 else Several(optimizer, inner)
        one = getattr(optimizer, "optimizer", None)
        if not _is_optimizer(one):
            break
        optimizer = one
    return optimizer


class Several:
    """Several optimizers read and written as one (a container's): their param groups in order, and each
    parameter's state where the optimizer that steps it keeps it."""

    def __init__(self, outer: Any, inner: list[Any]) -> None:
        self.outer, self.inner = outer, inner
        self.state = RoutedState(inner)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.inner for g in o.param_groups]


class RoutedState(MutableMapping[Any, Any]):
    """``state[p]`` of the inner optimizer that steps ``p`` (created there, as torch's ``defaultdict`` does)."""

    def __init__(self, inner: list[Any]) -> None:
        self.inner = inner
        # Looked up once per parameter and state key on a save or load: mapped once, not scanned each time.
        self._owners = {id(q): o for o in reversed(inner) for g in o.param_groups for q in g["params"]}

    def _owner(self, p: Any) -> Any:
        owner = self._owners.get(id(p))
        if owner is not None:
            return owner
        return next((o for o in self.inner if p in o.state), self.inner[0])

    def __getitem__(self, p: Any) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p: object) -> bool:
        return any(p in o.state for o in self.inner)

    def get(self, p: Any, default: Any = None) -> Any:
        return next((o.state[p] for o in self.inner if p in o.state), default)

    def __iter__(self) -> Iterator[Any]:
        return (p for o in self.inner for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.inner)
