"""vLLM's dense weight transfer, both ends, over a gloo group: what a ``WeightSource`` meets in vLLM 0.28-0.33.

Written from vLLM's released source (``vllm/distributed/weight_transfer/nccl_engine.py`` and
``packed_tensor.py``). The trainer side is ``NCCLTrainerWeightTransferEngine.send_weights``: the metadata read
once (a property from 0.33, a call before), every name/dtype/shape checked against iteration on the sender
(``_checked_iter``), the other trainer ranks iterating only to drive their gathers, and the packed producer: each
tensor flattened to bytes, a chunk closed right after the tensor that takes it past the buffer size, one
broadcast per chunk. The worker side is ``packed_nccl_broadcast_consumer``: the same chunk cut from the metadata
alone, each chunk split by sizes and every piece viewed in its dtype at its offset (``unpack_tensor``), which
fails for a tensor at an offset that is not a multiple of its itemsize. The data plane is gloo, not NCCL
(vLLM's communicator is NCCL-only); the worker loads into a transformers model by the Hub's names, as vLLM's
``load_weights`` takes them.
"""

from __future__ import annotations

import datetime
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from wrapkit import Bucket, BucketEntry
from wrapkit.integrations.vllm import load_into


def metadata_of(source: Any, interface: str) -> list[Any]:
    return list(source.metadata if interface == "0.33" else source.metadata())


def pairs_of(source: Any, interface: str) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(source.iter_full()) if interface == "0.33" else iter(source)


def checked(pairs: Iterator[tuple[str, torch.Tensor]], meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's ``_checked_iter``: what the sender yields against what the workers were told."""
    sent = 0
    for name, tensor in pairs:
        if sent >= len(meta):
            raise ValueError(f"WeightSource yielded more parameters than metadata declared; first extra {name!r}")
        m = meta[sent]
        if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
            raise ValueError(f"metadata disagrees with iteration at {sent}: {m.name!r} vs {name!r}")
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"WeightSource yielded {sent} parameters but metadata declared {len(meta)}")


def send(source: Any, interface: str, group: Any, buffer_bytes: int, is_sender: bool,
         stop_after: int | None = None) -> int:
    """One ``send_weights()`` on this trainer rank; returns the chunks broadcast. ``stop_after``: the sender's
    broadcast fails after that many tensors (as an NCCL error would), leaving the source unfinished."""
    meta = metadata_of(source, interface)
    if not is_sender:
        for _ in pairs_of(source, interface):
            pass
        return 0
    pairs = checked(pairs_of(source, interface), meta)
    chunks = taken = 0
    try:
        while True:
            tensors: list[torch.Tensor] = []
            total = 0
            for _, tensor in pairs:  # vLLM's pack_tensors: close right after the tensor that passes the size
                if stop_after is not None and taken == stop_after:
                    raise RuntimeError(f"broadcast failed after {taken} tensors")
                taken += 1
                flat = tensor.contiguous().view(-1).view(torch.uint8)
                tensors.append(flat)
                total += flat.numel()
                if total > buffer_bytes:
                    break
            if not tensors:
                return chunks
            group.broadcast([torch.cat(tensors)], dist.BroadcastOptions()).wait()
            chunks += 1
    finally:
        pairs.close()  # vLLM drops it with its frame; closing here makes that moment certain


def receive(meta: list[tuple[str, str, list[int]]], group: Any, buffer_bytes: int, model: torch.nn.Module) -> list[str]:
    """The worker's ``packed_nccl_broadcast_consumer`` for one update, loading each chunk into ``model``."""

    def chunks() -> Iterator[Bucket]:
        pending: list[tuple[str, list[int], torch.dtype, int]] = []
        total = 0
        for i, (name, dtype_name, shape) in enumerate(meta):
            dtype = getattr(torch, dtype_name)
            size = math.prod(shape) * dtype.itemsize
            pending.append((name, shape, dtype, size))
            total += size
            if total > buffer_bytes or i == len(meta) - 1:
                yield unpacked(pending, total)
                pending, total = [], 0

    def unpacked(pending: list[tuple[str, list[int], torch.dtype, int]], total: int) -> Bucket:
        packed = torch.empty(total, dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([packed], opts).wait()
        # vLLM's unpack_tensor: split by sizes, each piece viewed in its dtype where it lies.
        for (_, shape, dtype, _), piece in zip(pending, packed.split([p[3] for p in pending]), strict=True):
            piece.contiguous().view(dtype).view(shape)
        offsets = [sum(p[3] for p in pending[:i]) for i in range(len(pending))]
        entries = [BucketEntry(n, tuple(s), d, at) for (n, s, d, _), at in zip(pending, offsets, strict=True)]
        return Bucket(packed, entries)

    return load_into(model, chunks())


class TransferGroup:
    """The transfer group of trainer rank 0 (rank 0) and one engine worker (rank 1, a thread of this process
    with a model of its own), each a gloo group of two over one TCP store."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        wait = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=wait, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=wait)
        groups: dict[int, Any] = {}

        def join(rank: int, store: Any) -> None:
            groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("vllm-standin", store), rank, 2, wait)

        worker = threading.Thread(target=join, args=(1, client))
        worker.start()
        join(0, self.store)
        worker.join(timeout)
        self.trainer, self.worker = groups[0], groups[1]
        self.client = client

    def update(self, meta: list[tuple[str, str, list[int]]], buffer_bytes: int,
               model: torch.nn.Module) -> tuple[dict[str, Any], threading.Thread]:
        """The worker's side of one update, in a thread (as vLLM's RPC runs beside the broadcast)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["loaded"] = receive(meta, self.worker, buffer_bytes, model)
            except Exception as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return box, thread

    def close(self) -> None:
        del self.trainer, self.worker, self.client, self.store
