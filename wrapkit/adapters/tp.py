"""Tensor parallelism: a model whose parameters are DTensors with no wrapper around them
(torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` plans, or
transformers' ``from_pretrained(..., tp_plan=...)``). Nothing changes its class, so it is
recognised by what it holds (``claims``), once no wrapper matched.

The parameters lie on one device mesh, each ``Shard(d)`` or ``Replicate`` on each of its
dimensions (``_dtensor.py`` reads them); the layers the plan left alone keep plain tensors, the
same on every rank. TP's own input and output redistribution (torch's forward hooks, transformers'
replaced ``forward``) is taken out of the call path with the parameters full, so a gathered model
runs as the plain module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._gather import Bypass, broadcast_
from .._imports import lookup
from .._names import canonical_name
from ._base import Adapter, ShardedAdapter
from ._dtensor import (
    TP_HOOKS,
    Layout,
    full_copies,
    full_value,
    gather_many,
    is_dtensor,
    local_bytes,
    local_layout,
    local_placement,
    mesh_device,
    mesh_key,
    pieces,
    readable,
    refuse_tp_adapters,
    shard_map,
)
from ._likeness import distributed_copy
from ._primitives import Piece, Topology


class TensorParallelAdapter(ShardedAdapter):
    name = "tp"
    peels = False
    distributed = True

    @classmethod
    def claims(cls, module: torch.nn.Module) -> bool:
        """Whether ``module`` (no wrapper around it) holds DTensor parameters."""
        dtensor = lookup("torch.distributed.tensor", "DTensor")
        return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        return obj

    # -- layout ---------------------------------------------------------------------------------
    def _dtensors(self) -> Iterator[Any]:
        return (p for p in self._unique_parameters() if is_dtensor(p))

    def _layout(self) -> Layout | None:
        """The layout of the first parameter the plan splits (a replicated one splits nothing). Kept
        from the first read (at ``adapt()``): inside ``gathered()`` the module holds plain full copies,
        and the group, rank and mesh read off them would be gone."""
        kept: Layout | None = self.__dict__.get("_kept_layout")
        if kept is None:
            layouts = (Layout.of(p) for p in self._dtensors())
            kept = self.__dict__["_kept_layout"] = next((lay for lay in layouts if lay.shard_dims), None)
        return kept

    def _check_stack(self) -> None:
        refuse_tp_adapters(self.stack)

    def topology(self) -> Topology:
        layout = self._layout()
        if layout is None:
            return Topology(None, (), None)
        roles = tuple("tp" if d in layout.shard_dims else "replicate" for d in range(layout.mesh.ndim))
        group = layout.shard_group()
        # Every rank of the group holds a slice of each layer and takes the same batch.
        return Topology(group, tuple(layout.replica_groups()), layout.mesh, roles, tp_group=group)

    def unsupported_dtensor(self, p: Any) -> str | None:
        if not readable(p):
            return "placements other than Shard and Replicate are a layout the tp adapter cannot read"
        layout = self._layout()
        if layout is None or mesh_key(p.device_mesh) != mesh_key(layout.mesh):
            return "the parameters lie on different meshes, a layout the tp adapter cannot read"
        if len(layout.shard_dims) != 1:
            return "the plan splits parameters over several mesh dimensions, a layout the tp adapter cannot read"
        return None

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh()) or super().device

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    # -- shards and shapes ------------------------------------------------------------------------
    def global_numel(self, p: torch.Tensor) -> int:
        return p.numel()  # a DTensor reports its global shape

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}

    def resident_parameter_bytes(self) -> int:
        return local_bytes(self._unique_parameters())

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        return shard_map((canonical_name(n), p) for n, p in self.unwrap().named_parameters())

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return local_layout(self.unwrap())

    # -- gathering and writing back -------------------------------------------------------------
    def gather_bypass(self) -> Bypass:
        return Bypass(TP_HOOKS)

    def gather_one(self, p: torch.Tensor) -> torch.Tensor:
        return full_value(p)

    def gather_each(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One parameter at a time through ``gather_one``: a DTensor's full value, a plain tensor as it is.
        return Adapter.gather_each(self)

    def gather_units(self) -> list[list[torch.nn.Parameter]] | None:
        # Every parameter is split on its own, and any set of them goes in one collective (``gather_many``).
        return Adapter.gather_units(self)

    def gather_many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        yield from gather_many(params)

    def full_parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._unique_parameters())

    @contextlib.contextmanager
    def gather_full(self, modifier_rank: int | None) -> Iterator[Any]:
        plain = [p for p in self._unique_parameters() if not is_dtensor(p)]

        def written() -> None:
            # The layers the plan left alone hold plain tensors, one whole copy per rank: the
            # writer's values go to every rank, as the shards' do.
            assert modifier_rank is not None
            broadcast_([p.data for p in plain], modifier_rank, self.process_group(), self.world_size)
            self.weights_written()

        with full_copies(list(self._dtensors()), {}, modifier_rank, self.topology(), self.world_size,
                         written) as replace:
            yield replace

    @contextlib.contextmanager
    def gather_layerwise(self) -> Iterator[None]:
        yield  # the TP forward as it is: every rank runs each layer on its shards, together

    def load_pieces(self) -> list[Piece]:
        return pieces((canonical_name(n), p) for n, p in self.unwrap().named_parameters())

    # -- likeness ------------------------------------------------------------------------------------
    def fresh_copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        # Only transformers records the plan it applied; a plan applied by hand cannot be applied again.
        return distributed_copy(self) or super().fresh_copy(ds_config)

    # -- placement ----------------------------------------------------------------------------------
    def move(self, target: torch.device, copy: bool) -> None:
        # A DTensor's ``to()`` moves its local shard and keeps its placements.
        Adapter.move(self, target, copy)

    def placement_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return local_placement(super().placement_tensors())
