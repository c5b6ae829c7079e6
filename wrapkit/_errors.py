"""Error types. Each subclass also derives from the builtin it refines, so callers
that already catch ``TypeError`` or ``ValueError`` keep working."""

from __future__ import annotations

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
