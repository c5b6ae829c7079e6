"""One protocol for a model in training, whatever distributed wrapper holds it."""

from ._adapt import adapt, prepare_reference
from ._errors import (
    AdapterRegistrationError,
    ArgumentError,
    DistributedStateError,
    EngineError,
    MissingConfigError,
    MissingDependencyError,
    PlacementError,
    ReferenceModelError,
    StateDictError,
    UnsupportedModelError,
    WrapkitError,
)
from ._names import canonical_name
from ._protocol import WrappedModel
from ._registry import register_adapter, registered_adapters
from ._results import Bucket, BucketEntry, LoadResult, SleepReport, StateLoad
from .adapters import Adapter, ShardedAdapter
from .base.version import __version__
from .exchange.checkpoint import read_checkpoint
from .shutdown import shutdown

__all__ = [
    "__version__",
    "adapt",
    "register_adapter",
    "registered_adapters",
    "canonical_name",
    "prepare_reference",
    "WrappedModel",
    "LoadResult",
    "Adapter",
    "ShardedAdapter",
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
    "read_checkpoint",
    "Bucket",
    "BucketEntry",
    "SleepReport",
    "StateLoad",
    "shutdown",
]
