"""The backend primitives: what an adapter knows of its wrapper, and all that the operation
modules (placement, full parameters, state, reference, views) may use of it.

Every adapter implements this interface: its ``weights``, ``gatherer``, ``placement``, ``likeness`` and
``states`` parts (``core/parts.py``, one implementation per storage kind), its ``topology()``, and the members below.
``Adapter`` gives the whole-tensor parts, right for a wrapper that keeps whole parameters (DDP,
DataParallel). A sharded backend derives from ``ShardedAdapter`` instead and must define each of
``SHARDED_PRIMITIVES`` itself: there the unsharded default would be a silent wrong answer (local
shards taken for full tensors), so a missing one fails when the class is defined. Each member's
contract is its one-line docstring. Operations written against these work on every backend,
including third-party ones registered with ``register_adapter``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..._agree import Ranks
from .parts import Gatherer, Likeness, Piece, Placement, States, Weights, copy_into
from .topology import Topology

__all__ = ["AdapterView", "BackendPrimitives", "Piece", "Topology", "SHARDED_PRIMITIVES", "copy_into"]

Shape = tuple[int, ...]

# What a sharded adapter defines itself (``ShardedAdapter``): the parts that read, count, gather, write
# or move its weights, where the whole-tensor default would treat this rank's shard as the whole parameter;
# whether it is sharded; the ranks it lies over.
SHARDED_PRIMITIVES = ("parts", "is_sharded", "topology")


class BackendPrimitives(Protocol):
    # -- identity and group -------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Whether the backend needs a process group (and its operations are collective)."""
        ...

    @property
    def backend_object(self) -> torch.nn.Module | None:
        """The native wrapper object (DDP, FSDP root, DeepSpeed engine, FSDP2 root module), or None."""
        ...

    def topology(self) -> Topology:
        """The groups (and mesh) the model lies over; ``process_group()``, ``replica_groups()`` and
        ``mesh()`` are its parts, read off it by ``Adapter`` and never defined by a backend."""
        ...

    # -- parts ------------------------------------------------------------------------------------
    weights: Weights
    gatherer: Gatherer
    placement: Placement

    # -- names ------------------------------------------------------------------------------------
    def named_live(self, parameters: bool = True, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, this rank's live tensor) for every key of ``unwrap().state_dict()``, in its order:
        per module its parameters (tied ones under each name, shards where sharded), then its persistent
        buffers; ``parameters`` / ``buffers`` select which. The names every operation uses."""
        ...

    def merge_root(self) -> torch.nn.Module | None:
        """The PEFT model whose LoRA layers ``merge_adapters`` folds in, or None without one."""
        ...

    # -- likeness and states (each None where the backend has none) ----------------------------
    likeness: Likeness | None
    states: States | None

    def frozen_form(self) -> Any:
        """The adapter a frozen model keeps: itself, or the module inside a training-only wrapper."""
        ...


# What the modules the adapter base is built from (the checks of adapt(), describe(), the whole-tensor parts,
# likeness, the stage plan and parts) read of an adapter. ``Adapter`` implements it; they annotate with it rather
# than with ``Adapter``, so that none of them imports the base class that imports them. The group and this rank's
# place in it are the agreement's ``Ranks``.
class AdapterView(BackendPrimitives, Ranks, Protocol):
    @property
    def name(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def stack(self) -> tuple[str, ...]: ...

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def _module(self) -> torch.nn.Module: ...

    @property
    def _innermost(self) -> torch.nn.Module: ...

    @property
    def given_inside(self) -> str | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def zero_stage(self) -> int | None: ...

    @property
    def is_sharded(self) -> bool: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_rank(self) -> int: ...

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module: ...

    def num_parameters(self, trainable_only: bool = False) -> int: ...

    def describe(self) -> str: ...

    def resident_parameter_bytes(self) -> int: ...

    def replica_groups(self) -> list[Any]: ...

    def hub_layout(self) -> Any: ...

    def unsupported_dtensor(self, p: Any) -> str | None: ...

    def _unique_parameters(self) -> Iterator[torch.nn.Parameter]: ...
