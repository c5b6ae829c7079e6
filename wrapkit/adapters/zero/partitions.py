"""ZeRO-3's partitions: each parameter flattened, padded to a multiple of its group's size, and split
into equal slices, rank r holding the r-th (``_partition_param`` in
deepspeed/runtime/zero/partition_parameters.py). Reading them all in one all-gather, and writing
a rank's slice (with the optimizer's fp32 master where it keeps one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist

from ..._gather import all_gather_into
from ..core.primitives import copy_into

__all__ = ["each_full", "full_writer", "partition_writer", "settle_gathers"]


def settle_gathers(params: list[Any]) -> None:
    """Wait until every all-gather DeepSpeed started for ``params`` has finished.

    DeepSpeed's blocking gather of several parameters (``GatheredParameters``, ``param.all_gather``)
    starts one asynchronous all-gather per parameter and, before DeepSpeed 0.19 (PR #8539), waits for
    the last one only, then points each parameter at its buffer. On CUDA the stream orders them; on
    gloo each runs on a worker thread of its own, so an earlier one may still be filling its buffer:
    a read sees uninitialised memory, and a write made then is overwritten by the gather's late
    values (a load that loses some of what it wrote, a few runs in ten under DeepSpeed 0.16). A gloo
    barrier completes only after all the work queued before it on that group: one per group settles
    them all. Other backends order their work themselves: nothing to do."""
    groups: dict[int, Any] = {}
    for p in params:
        group = getattr(p, "ds_process_group", None)
        groups.setdefault(id(group), group)
    for group in groups.values():
        if dist.get_backend(group) == "gloo":
            dist.barrier(group=group)


def full_writer(p: Any, master: Callable[[Any], torch.Tensor | None] | None) -> Callable[[torch.Tensor], None]:
    """Write a whole (ZeRO 0-2) parameter, and its fp32 master where the optimizer keeps one."""
    write = copy_into(p.data)

    def both(values: torch.Tensor) -> None:
        write(values)
        if master is None:
            return
        with torch.no_grad():
            if hasattr(p, "_hp_mapping"):  # ZeRO 1-2, bf16 optimizer: this rank's fragment
                from deepspeed.utils import safe_set_full_fp32_param

                safe_set_full_fp32_param(p, values.reshape(p.shape).to(device=p.device, dtype=torch.float32))
            elif (own := master(p)) is not None:  # ZeRO-0's unfused optimizer: the fp32 parameter itself
                own.copy_(values.reshape(own.shape))
    return both


def partition_writer(p: Any, part: torch.Tensor, valid: int,
                      master: Callable[[Any], torch.Tensor | None] | None) -> Callable[[torch.Tensor], None]:
    """Write a ZeRO-3 partition (its first ``valid`` elements; the rest is padding), and its fp32 master."""
    write = copy_into(part.view(-1)[:valid])

    def both(values: torch.Tensor) -> None:
        write(values)
        if master is None:
            return
        from deepspeed.utils import safe_set_local_fp32_param

        with torch.no_grad():
            padded = torch.zeros(part.numel(), dtype=torch.float32, device=part.device)
            padded[:valid] = values.reshape(-1)
            safe_set_local_fp32_param(p, padded)
    return both


def each_full(todo: list[Any]) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(parameter, full value)`` of ZeRO-3 parameters, from one all-gather of their partitions
    (``_one_gather`` said it serves them); each value is cut out of the gathered buffer as it is
    reached. ZeRO-3 pads each flattened parameter to a multiple of its group's size and gives
    rank r the r-th equal slice (``_partition_param`` in deepspeed/runtime/zero/partition_parameters.py)."""
    if not todo:
        return
    group, dtype = todo[0].ds_process_group, todo[0].ds_tensor.dtype
    world = dist.get_world_size(group)
    sizes = [int(p.ds_tensor.ds_numel) for p in todo]
    parts = [p.ds_tensor.detach().reshape(-1) for p in todo]
    storage = parts[0].untyped_storage().data_ptr()
    with torch.no_grad():
        if all(x.data_ptr() + x.numel() * x.element_size() == y.data_ptr()
               and y.untyped_storage().data_ptr() == storage for x, y in pairwise(parts)):
            # ZeRO-3's optimizer keeps the partitions end to end in one flat buffer: send it as is.
            send = parts[0].as_strided((sum(sizes),), (1,), parts[0].storage_offset())
        else:
            send = torch.cat(parts)
        recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        all_gather_into(recv, send, group=group)
    by_rank = recv.view(world, send.numel())
    start = 0
    for p, size in zip(todo, sizes, strict=True):
        with torch.no_grad():
            full = by_rank[:, start: start + size].reshape(-1)[: int(p.ds_numel)].view(p.ds_shape)
        start += size
        yield p, full
