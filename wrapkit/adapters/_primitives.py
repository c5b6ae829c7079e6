"""The backend primitives: what an adapter knows of its wrapper, and all that the operation
modules (placement, full parameters, state, reference, views) may use of it.

Every adapter implements this interface. ``Adapter`` gives the defaults of an unsharded module,
right for a wrapper that keeps whole parameters (DDP, DataParallel), which overrides only what it
does differently. A sharded backend derives from ``ShardedAdapter`` instead and must define each
of ``SHARDED_PRIMITIVES`` itself: there the unsharded default would be a silent wrong answer (local
shards taken for full tensors), so a missing one fails when the class is defined. Each member's
contract is its one-line docstring. Operations written against these work on every backend,
including third-party ones registered with ``register_adapter``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from .._gather import Bypass
from ._topology import Topology

__all__ = ["BackendPrimitives", "Piece", "Topology", "SHARDED_PRIMITIVES", "copy_into"]

Shape = tuple[int, ...]

# What a sharded adapter defines itself (``ShardedAdapter``): whatever reads, counts, gathers, writes
# or moves weights, where the unsharded default would treat this rank's shard as the whole parameter.
SHARDED_PRIMITIVES = (
    "is_sharded", "topology", "global_numel", "full_shapes", "local_shards", "layout_tensors",
    "gather_each", "gather_units", "gather_many", "gather_full", "gather_layerwise", "gather_bypass",
    "full_parameter_bytes", "resident_parameter_bytes", "load_pieces", "move", "placement_tensors",
)


class Piece(NamedTuple):
    """Elements ``[start, start + numel)`` of the flattened full parameter ``name`` (shape
    ``full_shape``) that this rank holds; ``write(values)`` stores them (a 1-D tensor of ``numel``
    elements, any dtype) in this rank's storage, and in the optimizer's master copy where one is kept."""

    name: str
    start: int
    numel: int
    full_shape: Shape
    write: Callable[[torch.Tensor], None]


def copy_into(dst: torch.Tensor) -> Any:
    """A ``Piece.write`` that copies 1-D values into ``dst`` (any shape), cast to its dtype."""
    def write(values: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(values.reshape(dst.shape))
    return write


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

    # -- shards and shapes ----------------------------------------------------------------
    def global_numel(self, p: torch.Tensor) -> int:
        """Elements of the full parameter that ``p`` is (a shard of)."""
        ...

    def full_shapes(self) -> dict[int, Shape]:
        """``id(parameter)`` -> full shape, for the parameters whose local tensor is only a shard."""
        ...

    def param_shapes(self) -> dict[str, Shape]:
        """Canonical name -> full shape of every parameter (tied ones under each name); nothing gathered."""
        ...

    def named_live(self, parameters: bool = True, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, this rank's live tensor) for every key of ``unwrap().state_dict()``, in its order:
        per module its parameters (tied ones under each name, shards where sharded), then its persistent
        buffers; ``parameters`` / ``buffers`` select which. The names every operation uses."""
        ...

    def merge_root(self) -> torch.nn.Module | None:
        """The PEFT model whose LoRA layers ``merge_adapters`` folds in, or None without one."""
        ...

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        """Canonical name -> (this rank's shard, a layout key); None without one shard per parameter."""
        ...

    def layout_tensors(self) -> list[torch.Tensor] | None:
        """This rank's shard of every parameter, then every buffer, in one walk; None where ``local_shards`` is."""
        ...

    # -- gathering and writing back ----------------------------------------------------------
    def gather_each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical name, full tensor)`` for every parameter, gathered one (or one unit) at a time."""
        ...

    def gather_units(self) -> list[list[torch.nn.Parameter]] | None:
        """Every parameter (tied ones once), in the smallest sets gathered together; None: use ``gather_each``."""
        ...

    def gather_many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(parameter, full value in its own dtype)`` for whole units, in one collective where sharded."""
        ...

    def gather_exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``gather_many`` as a checkpoint holds the values: those the optimizer steps (fp32 masters)."""
        ...

    def gather_full(self, modifier_rank: int | None) -> contextlib.AbstractContextManager[Any]:
        """Every parameter full inside; writes on ``modifier_rank`` kept on exit; yields a ``Replace`` or None."""
        ...

    def gather_layerwise(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``unwrap()`` runs on the backend's own per-unit gathering (its forward gathers a
        unit, runs it and frees it); everything set up is undone on exit."""
        ...

    def full_parameter_bytes(self) -> int:
        """Bytes of every parameter gathered, in the dtype the backend gathers and computes in."""
        ...

    def gather_bypass(self) -> Bypass | None:
        """What must leave the call path for the module to run on full parameters (its hooks, wrappers), or None."""
        ...

    def load_pieces(self) -> list[Piece]:
        """This rank's part of every parameter (tied ones once), for filling it from a checkpoint."""
        ...

    def pieces_written(self) -> None:
        """Every ``load_pieces()`` piece was written: refresh what the backend derives from them."""
        ...

    def shards_written(self) -> None:
        """``local_shards()`` tensors were written in place: rebuild any full copies kept of them."""
        ...

    def masters_written(self, values: Mapping[str, torch.Tensor]) -> None:
        """Full values (canonical name -> tensor) were loaded: put them, exact, into any master copies."""
        ...

    def weights_written(self) -> None:
        """Weights were written in place (load, copy_to): refresh any private copies (master weights)."""
        ...

    # -- placement ------------------------------------------------------------------------------
    def move(self, target: torch.device, copy: bool) -> None:
        """Move this rank's parameters, gradients and buffers to ``target``, keeping every Parameter object."""
        ...

    def placement_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter, shard and buffer that placement moves and verifies."""
        ...

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter whose ``requires_grad`` goes off when the model is frozen."""
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
