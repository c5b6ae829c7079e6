"""Error types. Each subclass also derives from the builtin it refines, so callers
that already catch ``TypeError`` or ``ValueError`` keep working."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "WrapkitError",
    "UnsupportedModelError",
    "MissingConfigError",
    "ReferenceModelError",
    "PlacementError",
    "DistributedStateError",
    "MissingDependencyError",
    "AdapterRegistrationError",
    "StateDictError",
    "ArgumentError",
    "EngineError",
]


class WrapkitError(Exception):
    """Base class of every error raised on purpose by this package."""


class UnsupportedModelError(WrapkitError, TypeError):
    """The object is not a module, or is wrapped in something no adapter knows."""


class MissingConfigError(WrapkitError, AttributeError):
    """The innermost model has no ``config`` attribute."""


class ReferenceModelError(WrapkitError, ValueError):
    """A reference model cannot be built from what was passed."""


class PlacementError(WrapkitError, RuntimeError):
    """Parameters or shards are not on the device they should be on."""


class DistributedStateError(WrapkitError, RuntimeError):
    """The process group a wrapper relies on is missing, destroyed, or disagrees across ranks."""


class MissingDependencyError(WrapkitError, ImportError):
    """An optional library needed for this operation is not installed."""


class AdapterRegistrationError(WrapkitError, ValueError):
    """An adapter class is malformed or its name is already registered."""


class StateDictError(WrapkitError, ValueError):
    """A state dict, checkpoint file or copy source does not fit the model, or cannot be read."""


class ArgumentError(WrapkitError, ValueError):
    """An argument has a value the operation does not accept (e.g. an unknown mode or size)."""


class EngineError(WrapkitError, RuntimeError):
    """An inference engine in another process refused a call, failed, or did not answer in time. Raised
    on every trainer rank alike, with the engine's own answer quoted."""


class Listed(str):
    """Another typed error's message, listed among the problems a collective call reports together. It names its
    own cause and fix, so the call adds its own hint only for the problems without one; where every problem is
    such an error of one type, that type is raised."""

    error: type[WrapkitError]

    def __new__(cls, exc: WrapkitError) -> Listed:
        return _listed(str(exc), type(exc))

    def __reduce__(self) -> Any:  # gathered from other ranks as objects: the type travels with the text
        return (_listed, (str(self), self.error))

    def prefixed(self, prefix: str) -> Listed:
        return _listed(prefix + str(self), self.error)


def _listed(text: str, error: type[WrapkitError]) -> Listed:
    out = str.__new__(Listed, text)
    out.error = error
    return out


def first_few(items: Sequence[str], n: int) -> str:
    """The first ``n`` of ``items`` for a message, and how many more there are."""
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
