"""A gloo weight-transfer backend for vLLM's own server, registered as a vLLM plugin.

vLLM's transfer backends all need CUDA (NCCL, IPC, ...). This one is vLLM's dense NCCL engine with the data plane
replaced by a torch gloo group: the same init info, the same routes and session rules, the same packed wire (tensors
back to back in the metadata's order, a chunk closed right after the tensor that takes it past the buffer size),
each chunk handed to the model's ``load_weights`` as it arrives. It serves a CPU build of vLLM, and any trainer and
engine with no NCCL between them; the trainer side is ``VLLMEngine(url, backend="gloo")``.

wrapkit's package metadata declares it under vLLM's ``vllm.general_plugins`` entry point, which vLLM runs in every
one of its processes, so that with wrapkit installed beside vLLM::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'

takes the syncs. Nothing here is imported unless vLLM loads the plugin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["BACKEND", "register", "receive_packed"]

BACKEND = "gloo"
_Meta = list[tuple[str, str, list[int]]]


def register() -> None:
    """vLLM's plugin hook: the gloo backend in its weight-transfer registry (vLLM may call it more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def _chunks(meta: _Meta, buffer_bytes: int) -> Iterator[list[tuple[str, list[int], torch.dtype, int]]]:
    """The sender's cut: pieces accumulate until one takes the chunk past ``buffer_bytes``; the rest closes it."""
    pending: list[tuple[str, list[int], torch.dtype, int]] = []
    total = 0
    for name, dtype_name, shape in meta:
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        pending.append((name, list(shape), dtype, size))
        total += size
        if total > buffer_bytes:
            yield pending
            pending, total = [], 0
    if pending:
        yield pending


def receive_packed(meta: _Meta, group: Any, buffer_bytes: int, load: Any) -> None:
    """Receive one update's chunks from rank 0 of ``group`` and hand each to ``load`` as ``[(name, tensor)]``."""
    import torch.distributed as dist

    for pieces in _chunks(meta, buffer_bytes):
        packed = torch.empty(sum(p[3] for p in pieces), dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([packed], opts).wait()
        tensors, at = [], 0
        for name, shape, dtype, size in pieces:
            tensors.append((name, packed[at: at + size].view(dtype).view(shape)))
            at += size
        load(tensors)


def _engine_class() -> type:
    """Built on first use: its base class is vLLM's, importable only where vLLM is installed."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from ...base.process_groups import join_weight_group
    from ._vllm_dense import gloo_group_name

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):  # type: ignore[misc]
        """vLLM's dense engine over a torch gloo group of the trainer (rank 0) and the workers."""

        timeout = 60.0
        model_update_group: Any

        def init_transfer_engine(self, init_info: Any) -> None:
            self.packed = init_info.packed
            self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
            self.packed_num_buffers = init_info.packed_num_buffers
            if self.model_update_group is not None:  # a new session replaces the old group, as vLLM's does
                self.shutdown()
            config = self.parallel_config
            rank = init_info.rank_offset + config.data_parallel_index * config.world_size + config.rank
            self.model_update_group = join_weight_group(
                init_info.master_address, init_info.master_port, init_info.world_size, rank,
                gloo_group_name(init_info.master_port), "gloo", self.timeout)

        def receive_weights(self, update_info: Any) -> None:
            if self.model_update_group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            meta = list(zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True))
            buffer = self.packed_buffer_size_bytes if self.packed else 0  # unpacked: one broadcast per tensor
            receive_packed(meta, self.model_update_group, buffer, self.model.load_weights)

        def shutdown(self) -> None:
            import torch.distributed as dist

            group, self.model_update_group = self.model_update_group, None
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # its peers are gone already: nothing left to release
                    pass

    return GlooWeightTransferEngine


def __getattr__(name: str) -> Any:
    # vLLM's factory looks the class up by name on this module.
    if name == "GlooWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
