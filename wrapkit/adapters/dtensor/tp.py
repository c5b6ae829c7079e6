"""Tensor parallelism: a model whose parameters are DTensors with no wrapper around them
(torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` plans, or
transformers' ``from_pretrained(..., tp_plan=...)``). Nothing changes its class, so it is
recognised by what it holds (``claims``), once no wrapper matched.

The parameters lie on one device mesh, each ``Shard(d)`` or ``Replicate`` on each of its
dimensions (``dtensor/layout.py`` reads them); the layers the plan left alone keep plain tensors, the
same on every rank. TP's own input and output redistribution (torch's forward hooks, transformers'
replaced ``forward``) is taken out of the call path with the parameters full, so a gathered model
runs as the plain module.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..._gather import Bypass
from ..._imports import lookup
from ..core.kinds import ShardedAdapter
from ..core.likeness import ShardedLikeness, distributed_copy
from ..core.parts import Parts, lacking
from ..core.recipes import Recipe, Setting, dp_tp_mesh, tensor_parallel, whole
from ..core.topology import Role, Topology
from .layout import (
    TP_HOOKS,
    Layout,
    is_dtensor,
    mesh_device,
    mesh_key,
    readable,
    refuse_tp_adapters,
)
from .parts import dtensor_parts


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    return tensor_parallel(whole(model, setting), dp_tp_mesh(setting.device)["tp"])


class TensorParallelAdapter(ShardedAdapter):
    name = "tp"
    recipe = Recipe(("tp",), _build, order=9)
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

    @functools.cached_property
    def _layout(self) -> Layout | None:
        """The layout of the first parameter the plan splits (a replicated one splits nothing). Kept
        from the first read (at ``adapt()``): inside ``gathered()`` the module holds plain full copies,
        and the group, rank and mesh read off them would be gone."""
        return next((lay for lay in (Layout.of(p) for p in self._dtensors()) if lay.shard_dims), None)

    def _check_stack(self) -> None:
        refuse_tp_adapters(self.stack)

    def topology(self) -> Topology:
        layout = self._layout
        if layout is None:
            return Topology(None, (), None)
        roles = tuple(Role.TENSOR if d in layout.shard_dims else Role.REPLICATE for d in range(layout.mesh.ndim))
        group = layout.shard_group()
        # Every rank of the group holds a slice of each layer and takes the same batch.
        return Topology(group, tuple(layout.replica_groups()), layout.mesh, roles, tp_group=group)

    def unsupported_dtensor(self, p: Any) -> str | None:
        if not readable(p):
            return "placements other than Shard and Replicate are a layout the tp adapter cannot read"
        layout = self._layout
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

    def parts(self) -> Parts:
        return dtensor_parts(self, lambda: Bypass(TP_HOOKS)).replace(likeness=_TpLikeness(self))


class _TpLikeness(ShardedLikeness["TensorParallelAdapter"]):
    """Only transformers records the plan it applied: a copy applies it again, shard to shard. A plan applied by
    hand cannot be applied again, so neither copies nor wrapping are possible there."""

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        raise lacking(self.model.name, "likeness.wrap")

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        copied = distributed_copy(self.model)
        if copied is None:
            raise lacking(self.model.name, "likeness.copy", why=", because its plan was applied by hand and "
                          "tensor parallelism keeps no record of it")
        return copied
