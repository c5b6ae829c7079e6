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

    def __init__(self, port: int = 0, timeout: float = 60.0) -> None:
        wait = datetime.timedelta(seconds=timeout)
        # Port 0: the store takes one the system gives it as it binds (a port chosen earlier may have been taken
        # meanwhile by a group of the model's, as Megatron's many are).
        self.store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=wait, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", self.store.port, 2, is_master=False, timeout=wait)
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


class SparseSender:
    """vLLM 0.33's sparse weight transfer, both ends (``sparse_nccl_engine.py``), over a ``TransferGroup``.

    The trainer side is ``SparseNCCLTrainerWeightTransferEngine``: ``client`` (``start_weight_update`` /
    ``finish_weight_update``, no-ops on the worker: patches are applied in place) and ``send_weight_chunk``:
    each patch validated (int32 positions, 1-D, as many values as positions), the update info built from the
    patches (names, dtypes, full shapes, counts), the worker's receive started beside two broadcasts per patch,
    positions then values. The worker receives into empty tensors of the announced sizes and applies each patch
    to what it holds by flat position (``held``: the engine's tensors in the checkpoint's coordinates; a tensor
    it has never held starts as zeros). ``fail_on``: the worker's receive fails in that update (an RPC error);
    ``drop``: the worker silently leaves out sparse patches of tensors whose name contains it.
    """

    def __init__(self, transfer: TransferGroup, fail_on: int | None = None, drop: str | None = None) -> None:
        self.transfer, self.fail_on, self.drop = transfer, fail_on, drop
        self.held: dict[str, torch.Tensor] = {}
        self.syncs = 0
        self.client = self

    def start_weight_update(self) -> None:
        self.syncs += 1

    def finish_weight_update(self) -> None:
        pass

    def send_weight_chunk(self, patches: list[Any]) -> None:
        for p in patches:  # vLLM's _validate_patch
            if p.indices.dtype != torch.int32 or p.indices.ndim != 1 or p.values.ndim != 1:
                raise ValueError(f"Sparse weight patches must be 1D with int32 indices: {p.name}")
            if p.indices.numel() != p.values.numel():
                raise ValueError(f"`indices` and `values` must have matching lengths for {p.name}")
        info = [(p.name, str(p.values.dtype).split(".")[-1], list(p.full_shape), p.indices.numel()) for p in patches]
        box: dict[str, Any] = {}
        thread = threading.Thread(target=self._receive, args=(info, box), daemon=True)
        thread.start()
        opts = dist.BroadcastOptions()
        for p in patches:
            for t in (p.indices, p.values):
                self.transfer.trainer.broadcast([t], opts).wait()
        thread.join(60)
        if "error" in box:
            raise RuntimeError(box["error"])

    def _receive(self, info: list[tuple[str, str, list[int], int]], box: dict[str, Any]) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            got = []
            for name, dtype_name, shape, count in info:
                indices = torch.empty(count, dtype=torch.int32)
                values = torch.empty(count, dtype=getattr(torch, dtype_name))
                for t in (indices, values):
                    self.transfer.worker.broadcast([t], opts).wait()
                got.append((name, shape, indices, values))
            if self.syncs == self.fail_on:
                raise RuntimeError("Call to collective_rpc method failed: the stand-in's worker refused the patches")
            if any(not _valid(shape, indices, values) for _, shape, indices, values in got):
                raise ValueError("Sparse checkpoint patches contain NaN values, out-of-range indices, or duplicate "
                                 "indices")  # load_checkpoint_weight_patches' checks, before any write
            for name, shape, indices, values in got:  # in place, by flat position (not transactional)
                if self.drop is not None and self.drop in name and indices.numel() < math.prod(shape):
                    continue  # a sparse patch lost (a dense one, every position, still arrives)
                held = self.held.setdefault(name, torch.zeros(shape, dtype=values.dtype))
                held.view(-1)[indices.long()] = values
        except Exception as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"


def _valid(shape: list[int], indices: torch.Tensor, values: torch.Tensor) -> bool:
    """vLLM's checks of a sparse patch: no NaN value (NaN marks an unchanged position), positions in range, none
    twice."""
    if values.is_floating_point() and bool(values.isnan().any()):
        return False
    order = indices.long().sort().values
    return not order.numel() or (int(order[0]) >= 0 and int(order[-1]) < math.prod(shape)
                                 and not bool((order[1:] == order[:-1]).any()))
