"""The topology: the groups a model lies over and what each mesh dimension does, described once by its
backend (``Adapter.topology()``). Everything else about ranks is derived from it: the group, the copies,
the mesh, and which ranks take the same batch."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch.distributed as dist

__all__ = ["Role", "Topology"]


class Role(str, enum.Enum):
    """What the ranks along one mesh dimension hold. A ``str`` too, so that it compares, prints and
    serialises as its value (``Role.SHARD == "shard"``)."""

    REPLICATE = "replicate"  # copies of the model; each rank takes its own batches
    SHARD = "shard"  # slices of each parameter; each rank takes its own batches
    TENSOR = "tp"  # slices of each layer; the ranks share one batch
    PIPELINE = "pp"  # some of the layers each (pipeline stages); the ranks share one batch

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def shares_batch(self) -> bool:
        """Whether the ranks along a dimension of this role compute on one batch together."""
        return self in (Role.TENSOR, Role.PIPELINE)


class Topology(NamedTuple):
    """The groups a model lies over.

    ``group``: the ranks over which one copy of the model is sharded, or (unsharded backends)
    replicated; None is the default group. ``replicas``: where each copy is sharded within ``group``
    and copies repeat across other ranks (HSDP, HYBRID_SHARD), one group per such dimension, across
    the copies; else empty. ``mesh``: the DeviceMesh these groups are dimensions of, where the backend
    was given one; else None. ``roles``: the ``Role`` of each dimension of ``mesh``. ``tp_group``: the
    ranks that split each layer and share one batch (tensor parallelism), else None. ``cp_group``: the
    ranks within ``group`` that split the sequence of one shared batch (context parallelism folded into
    the dimension the model is sharded over), else None. Within ``group``, tp ranks are the innermost,
    cp ranks the next. ``pp_group``: one rank per pipeline stage, in stage order, where each holds some of the
    layers; they share one batch. It is either ``group`` itself (stages alone: one copy of the model lies
    over the stages) or outside it (stages beside FSDP2 or DDP, torchtitan's (pp, dp) mesh: ``group`` is
    the backend's own within one stage, and the stages are one more dimension around it). ``ep_group``: the
    ranks across which the experts of a mixture are split, each holding its own (expert parallelism within
    ``group``'s ranks), else None."""

    group: Any
    replicas: tuple[Any, ...]
    mesh: Any
    roles: tuple[Role, ...] = ()
    tp_group: Any = None
    cp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None

    def batch_sharing_groups(self) -> tuple[Any, ...]:
        """The groups within ``group``, innermost first, whose ranks compute on one batch together."""
        inside = None if self.pp_outside() else self.pp_group
        return tuple(g for g in (self.tp_group, self.cp_group, inside) if g is not None)

    def with_experts(self, ep_group: Any) -> Topology:
        """This topology with the experts split over ``ep_group`` (each rank holding its own, within the same
        ranks as the rest)."""
        return self._replace(ep_group=ep_group)

    def experts(self) -> tuple[int, int] | None:
        """(This rank's share of the experts, how many shares there are); None without expert parallelism."""
        if self.ep_group is None:
            return None
        return dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)

    def within_stages(self, pp_group: Any) -> Topology:
        """This topology as one stage's, with the pipeline's ``pp_group`` around it."""
        return self._replace(pp_group=pp_group)

    def pp_outside(self) -> bool:
        """Whether the pipeline stages are a dimension around ``group`` (each stage sharded or replicated
        by another backend) rather than ``group`` itself."""
        return self.pp_group is not None and self.pp_group is not self.group

    def outer_groups(self) -> tuple[Any, ...]:
        """The groups around ``group`` that, with it, span every rank holding part of the model: the
        replicas' (HSDP), then the pipeline's where it lies outside ``group``. An operation is agreed
        over all of them, and one rank of all of them writes files."""
        return (*self.replicas, self.pp_group) if self.pp_outside() else self.replicas

    def stage(self) -> tuple[int, int] | None:
        """(This rank's pipeline stage, how many there are); None without pipeline stages."""
        if self.pp_group is None:
            return None
        return dist.get_rank(self.pp_group), dist.get_world_size(self.pp_group)

    def size_and_rank(self) -> tuple[int, int]:
        """(How many ranks ``group`` has, this rank's index in it); (1, 0) without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def data_parallel(self) -> tuple[int, int]:
        """(How many different batches the ranks holding this model take at each step, which one this
        rank takes): the group's ranks less those sharing a batch, times the copies."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        size, rank = self.size_and_rank()
        for shared in self.batch_sharing_groups():
            n = dist.get_world_size(shared)
            size, rank = size // n, rank // n
        # Stages outside ``group`` share its batches: neither more batches nor another index.
        for g in self.replicas:  # each copy takes its own batches: copy index outermost
            size, rank = dist.get_world_size(g) * size, dist.get_rank(g) * size + rank
        return size, rank

    def mesh_text(self) -> str | None:
        """Each mesh dimension's name, size and role, on one line; None without a mesh."""
        mesh = self.mesh
        if mesh is None:
            return None
        names = getattr(mesh, "mesh_dim_names", None) or [f"dim{i}" for i in range(mesh.ndim)]
        roles: tuple[Any, ...] = self.roles or ("?",) * mesh.ndim
        return ", ".join(f"{n}={mesh.size(i)} {r}" for i, (n, r) in enumerate(zip(names, roles, strict=True)))
