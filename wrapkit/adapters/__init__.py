"""One adapter per backend; file name == backend name."""

from .._gather import Bypass
from ._base import Adapter, ShardedAdapter
from ._primitives import Topology
from .ddp import DDPAdapter
from .deepspeed import DeepSpeedAdapter
from .dp import DataParallelAdapter
from .fsdp import FSDPAdapter
from .fsdp2 import FSDP2Adapter
from .plain import PlainAdapter

__all__ = [
    "Adapter",
    "ShardedAdapter",
    "Bypass",
    "Topology",
    "PlainAdapter",
    "DataParallelAdapter",
    "DDPAdapter",
    "FSDPAdapter",
    "FSDP2Adapter",
    "DeepSpeedAdapter",
    "BUILTIN_ADAPTERS",
]

# Most specific first: a DeepSpeed engine or FSDP unit is checked before the
# generic replicated wrappers.
BUILTIN_ADAPTERS: tuple[type[Adapter], ...] = (
    DeepSpeedAdapter,
    FSDPAdapter,
    FSDP2Adapter,
    DDPAdapter,
    DataParallelAdapter,
)
