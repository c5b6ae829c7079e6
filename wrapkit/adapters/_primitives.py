"""The backend primitives: what an adapter knows of its wrapper, and all that the operation
modules (placement, full parameters, state, reference, views) may use of it.

Every adapter implements this interface: its ``weights``, ``gatherer`` and ``placement`` parts
(``_parts.py``, one implementation per storage kind), its ``topology()``, and the members below.
``Adapter`` gives the whole-tensor parts, right for a wrapper that keeps whole parameters (DDP,
DataParallel). A sharded backend derives from ``ShardedAdapter`` instead and must define each of
``SHARDED_PRIMITIVES`` itself: there the unsharded default would be a silent wrong answer (local
shards taken for full tensors), so a missing one fails when the class is defined. Each member's
contract is its one-line docstring. Operations written against these work on every backend,
including third-party ones registered with ``register_adapter``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ._parts import Gatherer, Piece, Placement, Weights, copy_into
from ._topology import Topology

__all__ = ["BackendPrimitives", "Piece", "Topology", "SHARDED_PRIMITIVES", "copy_into"]

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

    # -- sleep ------------------------------------------------------------------------------------
    def own_optimizer(self) -> Any:
        """The optimizer the backend holds itself (a DeepSpeed engine's), or None."""
        ...

    def optimizer_tensors(self, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``(what, tensor)`` of the state ``optimizer`` keeps for this rank."""
        ...

    def sleep_refusal(self) -> str | None:
        """Why the training state cannot go off the device and back, or None."""
        ...

    def offload_states(self, home: torch.device) -> Callable[[], None] | None:
        """The backend's own state to the CPU; returns what brings it back (None: nothing of its own)."""
        ...

    # -- likeness: references and frozen copies ---------------------------------------------------
    @property
    def takes_ds_config(self) -> bool:
        """Whether ``prepare_reference``'s ``ds_config`` applies: the reference is built from the backend's config."""
        ...

    @property
    def patches_torch_ops(self) -> bool:
        """Whether the backend's modules run on torch functions it replaced process-wide (ZeRO-3's)."""
        ...

    def bare_frozen(self) -> torch.nn.Module | None:
        """The module a frozen copy wrapped another way starts from, or None where this wrapper shards it."""
        ...

    def wrap_like(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        """``module`` (bare, whole, frozen) wrapped as this model is: its group or mesh, mixed precision, dtype."""
        ...

    def fresh_copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        """A frozen copy of this model wrapped like it; a sharded one filled shard to shard, never whole on a rank."""
        ...

    def frozen_form(self) -> Any:
        """The adapter a frozen model keeps: itself, or the module inside a training-only wrapper."""
        ...
