"""A process group beside the default one: the group an inference engine's workers open for weight updates,
joined by a trainer rank. torch builds such a group only through a private constructor (the engines use the
same one), kept here, in one place."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from .._errors import EngineError

__all__ = ["join_weight_group"]


def join_weight_group(address: str, port: int, world_size: int, rank: int, group_name: str, backend: str,
                      timeout: float) -> Any:
    """Join the group an engine's workers open for weight updates, as ``rank`` of ``world_size``.

    Built the way the engines build theirs (SGLang's ``init_custom_process_group``): a TCP store, wrapped
    in a prefix of the group's name, handed to torch's own group constructor, so that both sides' keys
    match. Rank 0 hosts the store itself: under torchrun a ``tcp://`` rendezvous would become a client of
    the agent's store, which the engine never reaches. Gloo connects every pair while the group is built,
    so this returns once every rank has joined, or raises after ``timeout`` seconds."""
    from torch.distributed import distributed_c10d as c10d

    c10d_any: Any = c10d
    dist_any: Any = dist
    # torch has no public constructor for a group outside the default one's ranks; SGLang and verl use this one.
    if not callable(getattr(c10d_any, "_new_process_group_helper", None)):
        raise EngineError("this torch release has no torch.distributed.distributed_c10d._new_process_group_helper, "
                          "which an engine's weight-update group is built with; use torch 2.6 or later")
    wait = datetime.timedelta(seconds=timeout)
    store = dist_any.TCPStore(address, port, world_size, is_master=rank == 0, timeout=wait, wait_for_workers=False)
    prefixed = dist_any.PrefixStore(group_name, store)
    try:
        group, _ = c10d_any._new_process_group_helper(world_size, rank, [], dist.Backend(backend), prefixed,
                                                      group_name=group_name, timeout=wait)
    except Exception as exc:
        raise EngineError(f"the weight-update group {group_name!r} at {address}:{port} was not joined by all "
                          f"{world_size} ranks within {timeout:.0f} s: {exc}") from exc
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
