"""``describe()``: an adapter's summary, one line per thing a user asks about a wrapped model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from ..stages.parts import StageWeights

if TYPE_CHECKING:
    from .primitives import AdapterView

__all__ = ["describe"]


def describe(adapter: AdapterView) -> str:
    """``adapter.describe()``: a human-readable multi-line summary."""
    mods = list(adapter._innermost.modules())
    training = sum(1 for m in mods if m.training)
    total = adapter.num_parameters()
    stage = adapter.topology().stage()
    # Counting what trains across pipeline stages (or expert-parallel ranks, read as stages) is a collective; a
    # summary never enters one.
    local = f"{sum(p.numel() for p in adapter._unique_parameters() if p.requires_grad):,} trainable"
    trainable = (f"{local} in this stage" if stage is not None else f"{local} held by this rank"
                 if isinstance(adapter.weights, StageWeights) else
                 f"{adapter.num_parameters(trainable_only=True):,} trainable")
    lines = [
        f"backend:      {adapter.backend}"
        + (f" (ZeRO stage {adapter.zero_stage})" if adapter.zero_stage is not None else ""),
        f"stack:        {' > '.join(adapter.stack)}",
        *([f"given:        the module inside the {adapter.given_inside}, not the {adapter.given_inside} itself "
           "(found from the module and read through it; its forward runs without the wrapper's)"]
          if adapter.given_inside else []),
        f"device:       {adapter.device}",
        f"group:        rank {adapter.rank} of {adapter.world_size}" + _replicas_text(adapter),
        *_mesh_lines(adapter),
        *([f"pipeline:     stage {stage[0]} of {stage[1]}, holding its own layers; the stages share each batch"]
          if stage is not None else []),
        *([f"experts:      share {experts[0]} of {experts[1]} (expert parallel), each rank holding its own"]
          if (experts := adapter.topology().experts()) is not None else []),
        f"sharded:      {'yes' if adapter.is_sharded else 'no'}",
        f"parameters:   {total:,} ({trainable}); "
        f"{adapter.resident_parameter_bytes() / 2**20:.2f} MiB held by this rank",
        f"mode:         {training} of {len(mods)} modules in training mode",
        f"config:       {type(getattr(adapter._innermost, 'config', None)).__name__}",
    ]
    return "\n".join(lines)

def _mesh_lines(adapter: AdapterView) -> list[str]:
    """The mesh, each dimension's size and role, and the batches, where the model lies on a mesh (or is split
    over tensor-parallel groups without one)."""
    topology = adapter.topology()
    dims = topology.mesh_text()
    if dims is None:
        # Tensor parallelism over groups without a mesh (Megatron-Core's): the split, and the batches.
        if topology.tp_group is None:
            return []
        tp = (dist.get_rank(topology.tp_group), dist.get_world_size(topology.tp_group))
        size, rank = adapter.data_parallel_size, adapter.data_parallel_rank
        return [f"tensor:       rank {tp[0]} of {tp[1]} (tensor parallel: a slice of each layer, one batch)",
                f"batches:      data-parallel rank {rank} of {size}"]
    size, rank = adapter.data_parallel_size, adapter.data_parallel_rank
    return [f"mesh:         {dims}", f"batches:      data-parallel rank {rank} of {size}"]

def _replicas_text(adapter: AdapterView) -> str:
    """Where the model is replicated across groups (HSDP): which copy this rank is in, of how many."""
    groups = adapter.replica_groups()
    if not groups:
        return ""
    copies = [(dist.get_rank(g), dist.get_world_size(g)) for g in groups]
    where = ", ".join(f"copy {r} of {n}" for r, n in copies)
    return f"; replicated: {where} (the shard group above holds one copy)"
