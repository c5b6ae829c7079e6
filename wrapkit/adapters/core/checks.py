"""What ``adapt()`` refuses of every adapter before any operation runs: a distributed wrapper without a
live process group, and DTensor parameters the adapter cannot read or write; and what a class statement
refuses of an adapter class: members that moved into its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..._errors import AdapterRegistrationError, DistributedStateError, UnsupportedModelError
from ..._imports import lookup
from ..._names import canonical_name
from .foreign import refuse_foreign
from .parts import MOVED_TO_PARTS

if TYPE_CHECKING:
    from .primitives import AdapterView

__all__ = ["check_group", "check_layout", "check_moved"]


def check_moved(cls: type) -> None:
    """Refuse an adapter class that defines a member operations no longer call (``MOVED_TO_PARTS``): it
    would be silently ignored."""
    moved = sorted(name for name in MOVED_TO_PARTS if name in vars(cls))
    if moved:
        raise AdapterRegistrationError(
            f"{cls.__name__} defines {', '.join(moved)}, which are now members of an adapter's parts "
            f"({', '.join(MOVED_TO_PARTS[n] for n in moved)}); return them from parts() (adapters/core/parts.py: "
            "Weights, Gatherer, Placement, Likeness, States), deriving from the parts of the storage kind closest "
            "to yours."
        )


def check_group(adapter: AdapterView) -> None:
    """Refuse a distributed wrapper whose process group is missing or destroyed."""
    if not adapter.distributed:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedStateError(
            f"{type(adapter._module).__name__} is a {adapter.name} wrapper but torch.distributed has no process "
            "group (never initialised, or destroyed); call adapt() between init_process_group() and "
            "destroy_process_group()."
        )
    group = adapter.process_group()
    try:
        # get_rank (unlike get_world_size) consults the registry of live groups.
        dist.get_rank(group)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DistributedStateError(
            f"the process group of this {adapter.name} wrapper ({type(adapter._module).__name__}) is no longer "
            f"valid ({exc}); it was probably destroyed. Re-create the group and wrap the model again."
        ) from exc


def check_layout(adapter: AdapterView) -> None:
    """Refuse a model partitioned by another framework (``core/foreign.py``), and one whose DTensor parameters
    this adapter cannot read or write: taken for unsharded, every operation after ``adapt()`` would hand
    out shards as full values."""
    refuse_foreign(adapter.module, adapter.name, getattr(adapter, "reads_marks", ()))
    dtensor = lookup("torch.distributed.tensor", "DTensor")
    if dtensor is None:  # never imported: no parameter can be one
        return
    for name, param in adapter._innermost.named_parameters():
        if not isinstance(param, dtensor):
            continue
        p: Any = param
        why = adapter.unsupported_dtensor(p)
        if why is None:
            continue
        mesh = p.device_mesh
        dims = f" ({', '.join(mesh.mesh_dim_names)})" if getattr(mesh, "mesh_dim_names", None) else ""
        raise UnsupportedModelError(
            f"{type(adapter._innermost).__name__} parameter {canonical_name(name)!r} is a DTensor with placements "
            f"{tuple(p.placements)} on a {mesh.ndim}-D mesh of {mesh.size()} ranks{dims}: {why}. Tensor "
            "parallelism is supported alone (parallelize_module over one mesh dimension, no wrapper around "
            "it) and beside fully_shard (FSDP2 over the dimensions before it of one named mesh), not under "
            "DDP, FSDP1 or DeepSpeed; shard the model with one of those alone, or use tensor parallelism "
            "with FSDP2."
        )
