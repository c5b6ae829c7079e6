"""One protocol for a model in training, whatever distributed wrapper holds it."""

from ._errors import (
    AdapterRegistrationError,
    ArgumentError,
    DistributedStateError,
    MissingConfigError,
    MissingDependencyError,
    PlacementError,
    ReferenceModelError,
    StateDictError,
    UnsupportedModelError,
    WrapkitError,
)
from ._names import canonical_name
from ._protocol import LoadResult, WrappedModel
from ._registry import register_adapter, registered_adapters
from ._wrapped import adapt, prepare_reference
from .adapters import Adapter, ShardedAdapter
from .exchange.checkpoint import read_checkpoint
from .shutdown import shutdown
from .sync.sleeping import SleepReport
from .sync.streaming import Bucket, BucketEntry
from .training.state import StateLoad

__version__ = "0.1.0"

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
    "read_checkpoint",
    "Bucket",
    "BucketEntry",
    "SleepReport",
    "StateLoad",
    "shutdown",
]
