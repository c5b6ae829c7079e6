"""One adapter per backend; file name == backend name."""

from .._gather import Bypass
from .core.base import Adapter
from .core.kinds import ShardedAdapter
from .core.parts import Gatherer, Likeness, Parts, Placement, States, Weights, Written
from .core.topology import Role, Topology
from .ddp import DDPAdapter
from .dp import DataParallelAdapter
from .dtensor.fsdp2 import FSDP2Adapter
from .dtensor.tp import TensorParallelAdapter
from .flat.fsdp import FSDPAdapter
from .pipeline import PipelineAdapter
from .plain import PlainAdapter
from .slices.megatron import MegatronAdapter
from .zero.deepspeed import DeepSpeedAdapter

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
