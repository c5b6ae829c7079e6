"""The parts of a model whose parameters are DTensors (``dtensor/layout.py`` reads them): FSDP2 and tensor
parallelism store their weights alike and differ only in the options given here.

``reshard``: what puts every parameter back in its sharded layout before the weights are read (FSDP2
leaves the root unsharded after a forward no backward followed; tensor parallelism never does).
``compute_dtypes``: id(parameter) -> the dtype the backend computes it in, where a mixed-precision
policy says another than its own. ``cast_hooks``: that policy's input and output casts, put back as
hooks of ours while ``bypassed`` has taken the backend's own out. ``bypass``: what leaves the call path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..._gather import Bypass, broadcast_
from ..._names import canonical_name
from ..core.parts import Parts, Written
from ..core.primitives import Piece
from ..core.whole import TorchStates, WholeGatherer, WholePlacement, WholeWeights
from .layout import full_copies, full_value, gather_many, is_dtensor
from .local import local_bytes, local_layout, local_placement, pieces, shard_map

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["dtensor_parts"]


def _nothing() -> None:
    return None


def dtensor_parts(model: Adapter, bypass: Callable[[], Bypass], *, reshard: Callable[[], None] = _nothing,
                  compute_dtypes: Callable[[], dict[int, torch.dtype]] = dict,
                  cast_hooks: Callable[[], list[Any]] = list) -> Parts:
    return Parts(DTensorWeights(model, reshard),
                 DTensorGatherer(model, bypass, reshard, compute_dtypes, cast_hooks),
                 DTensorPlacement(model), None, TorchStates())


class DTensorWeights(WholeWeights):
    def __init__(self, model: Adapter, reshard: Callable[[], None]) -> None:
        super().__init__(model)
        self.reshard = reshard

    def global_numel(self, p: torch.Tensor) -> int:
        return p.numel()  # a DTensor reports its global shape

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}  # and its full shape

    def resident_bytes(self) -> int:
        return local_bytes(self.model._unique_parameters())

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        self.reshard()
        # A parameter no plan split (or fully_shard left alone) is a plain tensor, whole on every rank.
        return shard_map((canonical_name(n), p) for n, p in self.model.unwrap().named_parameters())

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return local_layout(self.model.unwrap())

    def pieces(self) -> list[Piece]:
        self.reshard()  # write where the values come from
        return pieces((canonical_name(n), p) for n, p in self.model.unwrap().named_parameters())


class DTensorGatherer(WholeGatherer):
    def __init__(self, model: Adapter, bypass: Callable[[], Bypass], reshard: Callable[[], None],
                 compute_dtypes: Callable[[], dict[int, torch.dtype]], cast_hooks: Callable[[], list[Any]]) -> None:
        super().__init__(model)
        self._bypass, self.reshard, self.compute_dtypes, self.cast_hooks = bypass, reshard, compute_dtypes, cast_hooks

    def one(self, p: torch.Tensor) -> torch.Tensor:
        return full_value(p)

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.reshard()
        yield from super().each()

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        # Every parameter is split on its own, and any set of them goes in one collective (``many``).
        # Planned before anything is gathered, read after: the units must be the shards.
        self.reshard()
        return super().units()

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        self.reshard()
        yield from gather_many(params)

    def bypass(self) -> Bypass:
        return self._bypass()

    def full_bytes(self) -> int:
        dtypes = self.compute_dtypes()
        return sum(p.numel() * dtypes.get(id(p), p.dtype).itemsize for p in self.model._unique_parameters())

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[None]:
        # The backend's forward as it is: FSDP2 gathers unit by unit, tensor parallelism runs each layer on
        # its slices with every rank together. What a forward leaves unsharded is resharded on exit.
        try:
            yield
        finally:
            self.reshard()

    @contextlib.contextmanager
    def full(self, modifier_rank: int | None) -> Iterator[Any]:
        # Full copies of the shards are swapped in by ``bypassed``; the backend's own state is never
        # involved, so nothing of it needs restoring. Every parameter is a shard again first.
        model = self.model
        self.reshard()
        # Reading, the copies are in the dtype the forward computes in; writing (modifier_rank), in the
        # parameters' own dtype, so that the writes are kept exactly.
        dtypes = self.compute_dtypes() if modifier_rank is None else {}
        handles = self.cast_hooks() if dtypes else []
        params = list(model._unique_parameters())

        def written() -> None:
            # A parameter left plain is one whole copy per rank: the writer's values go to every rank.
            assert modifier_rank is not None
            broadcast_([p.data for p in params if not is_dtensor(p)], modifier_rank, model.process_group(),
                       model.world_size)
            model.weights.written(Written.WEIGHTS)

        try:
            with full_copies(params, dtypes, modifier_rank, model.topology(), model.world_size, written) as replace:
                yield replace
        finally:
            for handle in handles:
                handle.remove()


class DTensorPlacement(WholePlacement):
    # A DTensor's ``to()`` moves its local shard and keeps its placements (FSDP2's ``_apply`` re-registers
    # the padded local shards); only the check looks inside, at the local shards, which are what move.
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return local_placement(super().tensors())
