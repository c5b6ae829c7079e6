"""The parts an adapter is made of, one implementation per storage kind.

A backend's adapter says what its wrapper is (detection, peeling, device, topology) and hands out
the parts that say how its weights are stored, copied and put to sleep:

- ``Weights``: this rank's tensors, the full shapes, the slices a load fills;
- ``Gatherer``: full values out of the shards, and back in (one gather, write-back or roll-back);
- ``Placement``: moving this rank's tensors and naming what a move must have moved;
- ``Likeness`` (or None): frozen copies wrapped the way the model is, for references;
- ``States`` (or None): the training state kept beside the weights, and how it leaves the device.

A part a backend lacks is None, and the operation that needs it raises one typed error (``lacking``).

One implementation per storage kind: whole tensors (``core/whole.py``: plain, DataParallel, DDP, ZeRO
0-2), DTensors (``dtensor/parts.py``: FSDP2 and tensor parallelism, with options). A backend that
stores its weights like another passes that kind's parts, and writes none of its own.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from ..._errors import UnsupportedModelError
from ..._gather import Bypass

__all__ = ["Weights", "Gatherer", "Placement", "Likeness", "States", "Resume", "Held", "Parts", "Written", "Piece",
           "copy_into", "flat_view", "local_tensor", "MOVED_TO_PARTS", "lacking"]

Shape = tuple[int, ...]

# What adapters defined before they were made of parts, and the part member that does it now: an adapter
# class that still defines one is refused (``Adapter.__init_subclass__``), since nothing calls it any more.
MOVED_TO_PARTS = {
    "global_numel": "weights.global_numel", "full_shapes": "weights.full_shapes",
    "param_shapes": "weights.param_shapes",
    "local_shards": "weights.local_shards", "layout_tensors": "weights.layout_tensors", "load_pieces": "weights.pieces",
    "weights_written": "weights.written", "masters_written": "weights.written", "shards_written": "weights.written",
    "pieces_written": "weights.written", "gather_one": "gatherer.one", "gather_each": "gatherer.each",
    "gather_units": "gatherer.units", "gather_many": "gatherer.many", "gather_exported": "gatherer.exported",
    "gather_full": "gatherer.full", "gather_layerwise": "gatherer.layerwise", "gather_bypass": "gatherer.bypass",
    "full_parameter_bytes": "gatherer.full_bytes", "move": "placement.move", "placement_tensors": "placement.tensors",
    "frozen_parameters": "placement.frozen_parameters", "bare_frozen": "likeness.start", "wrap_like": "likeness.wrap",
    "fresh_copy": "likeness.copy", "takes_ds_config": "likeness.takes_config", "patches_torch_ops": "likeness.own_ops",
    "own_optimizer": "states.own_optimizer", "optimizer_tensors": "states.tensors", "offload_states": "states.offload",
    "sleep_refusal": "states (None where the backend cannot move them)",
}


class Piece(NamedTuple):
    """Elements ``[start, start + numel)`` of the flattened full parameter ``name`` (shape
    ``full_shape``) that this rank holds; ``write(values)`` stores them (a 1-D tensor of ``numel``
    elements, any dtype) in this rank's storage, and in the optimizer's master copy where one is kept.
    ``columns``: where set, ``(first, last)``, only those columns (dim 1) of the rows that range covers:
    ``write`` takes that block, flattened (a split along the columns, read without the other ranks')."""

    name: str
    start: int
    numel: int
    full_shape: Shape
    write: Callable[[torch.Tensor], None]
    columns: tuple[int, int] | None = None
    # The read side, for the training state (None: this piece cannot be read so). ``source``: the tensor an
    # optimizer holds for these elements, whose state it keys by it. ``values(t)``: those elements of
    # ``source``, or of an optimizer state tensor shaped like it, as a view: 1-D, or where ``box`` (offsets,
    # sizes in the full shape) is set, that block.
    source: torch.Tensor | None = None
    values: Callable[[torch.Tensor], torch.Tensor] | None = None
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # Where the read side above is not the module's weights (a 16-bit engine's optimizer steps fp32 masters, read
    # through its ``Resume`` part): these elements as the module holds them, 1-D (a delta sync diffs them).
    live: Callable[[], torch.Tensor] | None = None

    def block(self, full: torch.Tensor) -> torch.Tensor:
        """This piece's values out of the whole tensor ``full``, flattened, as ``write`` takes them."""
        if self.columns is None:
            return full.reshape(-1)[self.start:self.start + self.numel]
        row = math.prod(self.full_shape[1:])
        first, last = self.start // row, (self.start + self.numel) // row
        return full.reshape(self.full_shape)[first:last, self.columns[0]:self.columns[1]].reshape(-1)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A ``Piece.values`` for a piece that is all of its (contiguous) source: its elements flattened, a view."""
    return t.detach().view(-1)


def copy_into(dst: torch.Tensor) -> Any:
    """A ``Piece.write`` that copies 1-D values into ``dst`` (any shape), cast to its dtype."""
    def write(values: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(values.reshape(dst.shape))
    return write


class Written(enum.Enum):
    """What was just written, for ``Weights.written`` to refresh what the backend derives from it."""

    WEIGHTS = "the module's weights, in place (a load, copy_to, gathered(modifier_rank=...))"
    SHARDS = "this rank's local_shards(), in place (a shard-to-shard sync)"
    PIECES = "every pieces() piece (a load), master copies included where the pieces keep them"
    VALUES = "full values loaded: master copies of 16-bit weights take them exactly"


class Weights(Protocol):
    def global_numel(self, p: torch.Tensor) -> int:
        """Elements of the full parameter that ``p`` is (a shard of)."""
        ...

    def full_shapes(self) -> dict[int, Shape]:
        """``id(parameter)`` -> full shape, for the parameters whose local tensor is only a shard."""
        ...

    def count(self, trainable_only: bool) -> int:
        """Global parameter count (trainable ones only, if asked), shared (tied) parameters counted once."""
        ...

    def param_shapes(self) -> dict[str, Shape]:
        """Canonical name -> full shape of every parameter (tied ones under each name); nothing gathered."""
        ...

    def resident_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (shards, and anything gathered); no collective."""
        ...

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        """Canonical name -> (this rank's shard, a layout key); None without one shard per parameter."""
        ...

    def layout_tensors(self) -> list[torch.Tensor] | None:
        """This rank's shard of every parameter, then every buffer, in one walk; None where ``local_shards`` is."""
        ...

    def pieces(self) -> list[Piece]:
        """This rank's part of every parameter (tied ones once), for filling it from a checkpoint."""
        ...

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """``kind`` was written (``values``: the full values, for ``Written.VALUES``): refresh what the backend
        keeps derived from it (full copies of shards, an optimizer's master weights). Collective where the
        backend's refresh is."""
        ...


class Gatherer(Protocol):
    def one(self, p: torch.Tensor) -> torch.Tensor:
        """The full value of parameter ``p``."""
        ...

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical name, full tensor)`` for every parameter, gathered one (or one unit) at a time."""
        ...

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        """Every parameter (tied ones once), in the smallest sets gathered together; None: use ``each``."""
        ...

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(parameter, full value in its own dtype)`` for whole units, in one collective where sharded."""
        ...

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``many`` as a checkpoint holds the values: those the optimizer steps (fp32 masters) where it keeps them."""
        ...

    def full(self, modifier_rank: int | None) -> contextlib.AbstractContextManager[Any]:
        """Every parameter full inside; writes on ``modifier_rank`` kept on exit; yields a ``Replace`` or None."""
        ...

    def layerwise(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the module runs on the backend's own per-unit gathering; everything set up is undone on exit."""
        ...

    def bypass(self) -> Bypass | None:
        """What must leave the call path for the module to run on full parameters, or None."""
        ...

    def full_bytes(self) -> int:
        """Bytes of every parameter gathered, in the dtype the backend gathers and computes in."""
        ...


class Placement(Protocol):
    def move(self, target: torch.device, copy: bool) -> None:
        """Move this rank's parameters, gradients and buffers to ``target``, keeping every Parameter object."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter, shard and buffer that placement moves and verifies."""
        ...

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter whose ``requires_grad`` goes off when the model is frozen."""
        ...


class Likeness(Protocol):
    """Copies like the model, for ``prepare_reference`` and the trainer drop-ins: a frozen reference
    wrapped the way the policy is."""

    # Whether ``prepare_reference``'s ``ds_config`` applies: copies are built from the backend's own config.
    takes_config: bool
    # Whether copies run on torch functions the backend replaced process-wide (ZeRO-3's), not torch's own.
    own_ops: bool

    def start(self) -> torch.nn.Module | None:
        """The module a copy wrapped another way starts from (the module inside a replicated wrapper, which
        adds nothing to a frozen model); None where the wrapper shards it."""
        ...

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        """``module`` (bare, whole, frozen) wrapped as this model is: its group or mesh, mixed precision, dtype."""
        ...

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        """A frozen copy of this model wrapped like it; a sharded one filled shard to shard, never whole on a rank."""
        ...


class States(Protocol):
    """The training state beside the weights (gradients, the optimizer's), for ``sleep`` / ``wake``."""

    def own_optimizer(self) -> Any:
        """The optimizer the backend holds itself (a DeepSpeed engine's), or None."""
        ...

    def tensors(self, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``(what, tensor)`` of the state ``optimizer`` keeps for this rank."""
        ...

    def offload(self, home: torch.device) -> Callable[[], None] | None:
        """The backend's own state to the CPU; returns what brings it back to ``home``. None: it keeps nothing
        of its own, so the parameters go through ``Placement.move`` and the caller moves the optimizer's state."""
        ...


class Held(NamedTuple):
    """Elements ``[start, start + numel)`` of the flattened full parameter ``name`` as the optimizer steps them
    on this rank: ``weights`` (its master copy where it keeps one), ``state`` (each per-element tensor of its
    state: Adam's moments) and ``scalars`` (the rest of it: Adam's ``step``), tensors written in place by a
    load. ``weights`` and each ``state`` tensor are 1-D views of ``numel`` elements, or where ``box`` (offsets,
    sizes in the full shape) is set, views of that block. ``owner``: the tensor the optimizer keys that state by."""

    name: str
    full_shape: Shape
    start: int
    numel: int
    weights: torch.Tensor
    state: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    owner: torch.Tensor
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class Resume(Protocol):
    """The training state of a backend whose optimizer keeps it outside the torch optimizer's view of the model's
    parameters (a DeepSpeed engine's flat fp32 partitions), for ``save_state`` / ``load_state``. Backends
    without one are read through ``Weights.pieces`` and the torch optimizer's ``state``."""

    def optimizer(self) -> Any:
        """The torch optimizer that steps (its class and hyperparameters are what a checkpoint records)."""
        ...

    def group_names(self) -> list[list[str]]:
        """The canonical names of the parameters in each of its param groups."""
        ...

    def held(self) -> list[Held]:
        """This rank's part of every trained parameter's weights and state."""
        ...

    def create(self, keys: Mapping[str, Mapping[str, tuple[bool, torch.dtype, tuple[int, ...]]]]) -> None:
        """Give an optimizer that has not stepped the state a checkpoint holds, as zeros to load into: ``keys``
        maps a parameter's name to each state key's (per element, dtype, shape where not per element)."""
        ...

    def loaded(self) -> None:
        """``held()``'s tensors were written: refresh what the backend derives from them (its 16-bit weights).
        Collective where that refresh is."""
        ...


class Parts(NamedTuple):
    """What ``Adapter.parts()`` returns: the storage kind's parts for this model, and the backend's likeness
    and states, each None where the backend has none."""

    weights: Weights
    gatherer: Gatherer
    placement: Placement
    likeness: Likeness | None = None
    states: States | None = None
    resume: Resume | None = None

    def replace(self, **parts: Any) -> Parts:
        """These parts with those named replaced: a backend's ``likeness=`` and ``states=`` beside its storage
        kind's."""
        return self._replace(**parts)


# What an operation says when the model's backend lacks the part it needs: written once, here.
_LACKING = {
    "likeness.wrap": "cannot wrap a reference model the way its policy is wrapped{why}; wrap ref_model in {backend} "
                     "yourself (the policy's mesh and plan) and pass it to prepare_reference.",
    "likeness.copy": "cannot build a frozen copy of its model{why}; pass ref_model to prepare_reference (the model "
                     "loaded again from its checkpoint, wrapped in {backend}).",
    "states": "cannot move this model's training state off the device and back{why} (a DeepSpeed engine moves its "
              "own with offload_states(): ZeRO-1/2/3 from DeepSpeed 0.17, and only with an optimizer); upgrade "
              "DeepSpeed, or use place('cpu') to move the parameters alone.",
}


def lacking(backend: str, part: str, why: str = "") -> UnsupportedModelError:
    """The typed error for an operation that needs ``part`` (a key of ``_LACKING``) of a ``backend``
    model that has none; ``why`` (", because ...") says more where the backend knows it."""
    return UnsupportedModelError(f"the {backend} backend " + _LACKING[part].format(backend=backend, why=why))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself. Read from the field: ``to_local()``
    returns the same storage through an autograd function, ~30 us a call that a frequent sync repeats."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t
