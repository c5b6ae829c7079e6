"""One adapter per backend; file name == backend name."""

from .._gather import Bypass
from ._base import Adapter
from ._kinds import ShardedAdapter
from ._parts import Gatherer, Likeness, Parts, Placement, States, Weights, Written
from ._topology import Role, Topology
from .ddp import DDPAdapter
from .deepspeed import DeepSpeedAdapter
from .dp import DataParallelAdapter
from .fsdp import FSDPAdapter
from .fsdp2 import FSDP2Adapter
from .megatron import MegatronAdapter
from .pipeline import PipelineAdapter
from .plain import PlainAdapter
from .tp import TensorParallelAdapter

__all__ = [
    "Adapter",
    "ShardedAdapter",
    "Bypass",
    "Topology",
    "Role",
    "Parts",
    "Weights",
    "Gatherer",
    "Placement",
    "Likeness",
    "States",
    "Written",
    "PlainAdapter",
    "DataParallelAdapter",
    "DDPAdapter",
    "FSDPAdapter",
    "FSDP2Adapter",
    "DeepSpeedAdapter",
    "TensorParallelAdapter",
    "PipelineAdapter",
    "MegatronAdapter",
    "BUILTIN_ADAPTERS",
    "CONTENT_ADAPTERS",
]

# Most specific first: a DeepSpeed engine or FSDP unit is checked before the
# generic replicated wrappers.
BUILTIN_ADAPTERS: tuple[type[Adapter], ...] = (
    MegatronAdapter,
    DeepSpeedAdapter,
    FSDPAdapter,
    FSDP2Adapter,
    DDPAdapter,
    DataParallelAdapter,
)

# Backends with no wrapper object and no class of their own, recognised by what the model holds
# (``claims``), tried on the innermost module once no wrapper matched.
CONTENT_ADAPTERS: tuple[type[MegatronAdapter] | type[TensorParallelAdapter] | type[PipelineAdapter], ...] = (
    MegatronAdapter, TensorParallelAdapter, PipelineAdapter)
