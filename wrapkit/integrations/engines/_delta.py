"""Deltas to an engine: after a dense first sync, only the values that changed, as sparse patches in the Hub's
coordinates (vLLM's ``sparse_nccl`` backend, 0.33).

A sparse round is diffed where the weights live (``sync/deltas.py``): each rank compares its own part of every
parameter, in the wire dtype, with its snapshot of that part, maps the changed elements to the Hub's tensors and
positions, and only those go to the sending rank, one bucket of Hub tensors at a time; nothing is gathered whole.
Where the model's Hub tensors are not picked from its own element by element (merged LoRA, a computed layout) or
a backend's parts cannot be read in place, the round gathers instead: the full weights are streamed to every
rank (``stream_full_parameters``' own gathers), each rank compares its flat share ``[r * n // W, (r + 1) * n //
W)`` of each tensor with its snapshot, and the changes go to the sending rank the same way. Dense rounds stream
everything. Applied to what the engine holds, the patches give exactly what a dense sync of the same stream
gives. The snapshot takes in a round's changes only once every rank knows the send succeeded; after a failed send
the next sync is dense.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..._errors import ArgumentError, EngineError
from ...sync import changes
from ...sync.deltas import Change, ShardDiff
from ._engine_wire import rank, refuse_partial, share, world_size

__all__ = ["DeltaSync", "DeltaReport", "SparsePatch"]

_LIMIT = 2**31 - 1  # vLLM's patches carry int32 flat positions


class SparsePatch(NamedTuple):
    """One tensor's changes: flat positions (int32, ascending) and their values, in the checkpoint's (Hub's)
    coordinates; the fields of vLLM's ``SparseWeightPatch``, which is used instead where vLLM is installed."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: tuple[int, ...]


class DeltaReport(NamedTuple):
    """What one ``DeltaSync.send`` moved, the same on every rank: whether it was dense, the patches (tensors),
    the values sent and the model's values, the bytes of positions and values, and the seconds taken.
    ``diffed``: ``"dense"``, or where a sparse round compared the values: ``"shards"`` (each rank its own part,
    before any gather) or ``"gathered"`` (the full tensors gathered first, then compared), with ``why`` the reason
    for the latter."""

    dense: bool
    tensors: int
    changed: int
    values: int
    bytes: int
    seconds: float
    diffed: str = "dense"
    why: str | None = None


class DeltaSync:
    """Sparse weight updates of ``wm`` for an engine in another process; see the module docstring.

    ``dtype``, ``keep_dtype``, ``merge_adapters``, ``bucket_bytes``: as in ``stream_full_parameters`` (the wire
    dtype is what the snapshot holds, so a patch gives exactly the values a dense sync would). ``snapshot_device``:
    where each rank keeps its share of the snapshot (``"cpu"`` by default; its size is the model's values in the
    wire dtype divided by the world size). ``dense_every``: every that many syncs one is dense (vLLM cannot
    confirm a checksum of what it holds in the checkpoint's coordinates, so this bounds how long a lost patch is
    served); None: only the first and those after ``reset()``. ``src_rank``: the rank that sends (a global rank).
    """

    def __init__(self, wm: Any, *, dtype: torch.dtype | None = None, keep_dtype: Callable[[str], bool] | None = None,
                 merge_adapters: bool = False, bucket_bytes: int = 64 * 2**20,
                 snapshot_device: torch.device | str = "cpu", dense_every: int | None = 50, src_rank: int = 0) -> None:
        if dense_every is not None and (isinstance(dense_every, bool) or not isinstance(dense_every, int)
                                        or dense_every < 1):
            raise ArgumentError(f"DeltaSync(): dense_every={dense_every!r}: pass a positive number of syncs, or None")
        refuse_partial(wm, "DeltaSync()", "its shares of the snapshot are cut over every rank of the job",
                       ". Send each model of a job in sub-groups with stream_full_parameters")
        self.wm, self.dtype, self.keep_dtype, self.merge_adapters = wm, dtype, keep_dtype, merge_adapters
        self.bucket_bytes, self.dense_every, self.src_rank = bucket_bytes, dense_every, src_rank
        self.snapshot_device = torch.device(snapshot_device)
        self._shards = ShardDiff(wm, dtype, keep_dtype, self.snapshot_device) if not merge_adapters else None
        self._snapshot: dict[str, torch.Tensor] = {}
        self._gather_always = False
        self._dense = True
        self._syncs = 0

    def reset(self) -> None:
        """The next sync is dense (call it on every rank after the engine loaded weights from elsewhere)."""
        self._dense = True

    def snapshot_bytes(self) -> int:
        """This rank's snapshot, in bytes."""
        own = self._shards.snapshot_bytes() if self._shards is not None else 0
        return own + sum(t.numel() * t.element_size() for t in self._snapshot.values())

    def _why_gathered(self) -> str | None:
        """Why this model's values are gathered before they are compared (None: each rank compares its own part).
        Collective the first time (every rank calls ``send``)."""
        if self._shards is None:
            return "merged LoRA changes the whole merged weight: the merged tensors are gathered and compared"
        if self._gather_always:  # the benchmark's side-by-side of both ways
            return "asked to gather"
        return self._shards.plan()

    def send(self, sender: Any) -> DeltaReport:
        """One sync, collective: every rank calls it. ``sender`` (used on the sending rank only): vLLM's sparse
        trainer engine (``trainer_init`` of ``SparseNCCLTrainerInitInfo``), whose ``send_weight_chunk`` takes each
        bucket's patches inside one ``start_weight_update`` / ``finish_weight_update`` of its client; or
        ``VLLMEngine`` (``send_patches``, a server with wrapkit's ``sparse_gloo`` backend), or anything with
        ``send_weights(patches)``, given the round's patches at once. Raises ``EngineError`` on
        every rank where the send failed (the next sync is then dense)."""
        t0 = time.perf_counter()
        dense, me, world = self._dense, rank(), world_size()
        why = self._why_gathered()
        out = _Round(sender, self.src_rank, self.wm.device)
        if not dense and why is None:
            return self._send_shards(out, t0)
        pending: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
        stream = self.wm.stream_full_parameters(self.bucket_bytes, self.dtype, self.merge_adapters,
                                                keep_dtype=self.keep_dtype)
        for bucket in stream:
            local = []
            for name, full in bucket.named_tensors():
                n = out.tensor(name, full.numel())
                lo, hi = n * me // world, n * (me + 1) // world
                mine = full.reshape(-1)[lo:hi].to(self.snapshot_device)
                snap = self._snapshot.get(name)
                if dense or snap is None or snap.dtype != mine.dtype or snap.numel() != mine.numel():
                    where, picked = None, mine.clone()
                    positions = torch.arange(lo, hi, dtype=torch.int32)
                else:
                    where = changes.changed(mine, snap)
                    picked = changes.take(mine, where)
                    positions = (where + lo).to(torch.int32)
                local.append((name, tuple(full.shape), full.dtype, positions, picked))
                if why is not None:  # the shard snapshot is taken after the round instead
                    pending.append((name, where, picked))
            out.bucket(local)
            del bucket
        tensors, changed, size = self._finished(out, dense)
        changes.commit(self._snapshot, pending)
        if why is None and self._shards is not None:
            self._snapshot = {}
            self._shards.take()
        return DeltaReport(dense, tensors, changed, out.values, size, time.perf_counter() - t0,
                           "dense" if dense else "gathered", None if dense else why)

    def _send_shards(self, out: _Round, t0: float) -> DeltaReport:
        """A sparse round diffed on the ranks' own parts: only the changes are gathered, to the sending rank,
        one bucket of Hub tensors at a time."""
        assert self._shards is not None
        diffs = self._shards.diff()
        for name, shape, _ in self._shards.hub_order:
            out.tensor(name, math.prod(shape))
        for bucket in _buckets(diffs, self.bucket_bytes):
            out.bucket([(c.name, c.shape, c.dtype, c.positions.to(torch.int32), c.values) for c in bucket])
        tensors, changed, size = self._finished(out, False)
        self._shards.commit()
        return DeltaReport(False, tensors, changed, out.values, size, time.perf_counter() - t0, "shards", None)

    def _finished(self, out: _Round, dense: bool) -> tuple[int, int, int]:
        """The round's outcome on every rank: its counts, or ``EngineError`` everywhere (the next sync dense)."""
        error, tensors, changed, size = out.finish()
        if error is not None:
            self._dense = True  # what the engine holds is unknown: the next sync sends everything
            raise EngineError(f"DeltaSync.send(): the {'dense' if dense else 'sparse'} update failed: {error}. "
                              "Nothing was taken into the snapshot; the next sync is dense")
        self._syncs += 1
        self._dense = self.dense_every is not None and self._syncs % self.dense_every == 0
        return tensors, changed, size


class _Round:
    """The sending side of one update: each bucket's changes joined on the sending rank and handed to ``sender``
    (``send_weight_chunk`` inside one session of its client, or held for ``send_weights`` at the end), counted;
    then the outcome shared by every rank."""

    def __init__(self, sender: Any, src_rank: int, device: torch.device) -> None:
        self.sender, self.src, self.device = sender, src_rank, device
        self.sends, self.world = rank() == src_rank, world_size()
        self.chunked = self.sends and callable(getattr(sender, "send_weight_chunk", None)) and hasattr(sender,
                                                                                                       "client")
        self.error = _attempt(sender.client.start_weight_update) if self.chunked else None
        self.held: list[Any] = []  # the round's patches, where the sender takes them at once
        self.tensors = self.changed = self.values = self.size = 0

    def tensor(self, name: str, n: int) -> int:
        """Count a tensor of ``n`` values that the round covers (vLLM's patches address it with int32)."""
        self.values += n
        if n > _LIMIT:
            self.error = self.error or f"{name} has {n} values, more than int32 positions address"
        return n

    def bucket(self, local: list[tuple[str, tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor]]) -> None:
        patches = _to_sender(local, self.src, self.world, self.device)
        if not self.sends:
            return
        self.tensors += len(patches)
        self.changed += sum(p.values.numel() for p in patches)
        self.size += sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size() for p in patches)
        if self.error is None and patches:
            self.error = _nan_in(patches)
        if self.error is None and patches:  # nothing of a refused bucket goes out
            patches = [_patch(p) for p in patches]
            if self.chunked:
                self.error = _attempt(self.sender.send_weight_chunk, patches)
            else:
                self.held += patches

    def finish(self) -> tuple[str | None, int, int, int]:
        if self.sends and self.error is None:
            self.error = (_attempt(self.sender.client.finish_weight_update) if self.chunked
                          else _attempt(getattr(self.sender, "send_patches", None) or self.sender.send_weights,
                                        self.held))
        self.held.clear()
        out: tuple[str | None, int, int, int] = share((self.error, self.tensors, self.changed, self.size), self.src)
        return out


def _to_sender(local: list[tuple[str, tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor]], src: int,
               world: int, device: torch.device) -> list[SparsePatch]:
    """Every rank's changes of one bucket (each tensor's positions ascending on each rank), joined on the sending
    rank, on ``device`` (the model's: where the collectives and the engine's broadcasts run); a patch per tensor
    with changes. Two collectives: the sizes, then each rank's counts, positions and values in one padded
    buffer."""
    if world == 1:
        return [SparsePatch(n, p.to(device), v.to(device).contiguous(), s) for n, s, _, p, v in local if p.numel()]
    # One byte buffer per rank: the counts (int64), the positions (int32), then each tensor's values; every
    # section starts at a multiple of 8 bytes, so the sender reads each in place through a view of its dtype.
    counts = [p.numel() for *_, p, _ in local]
    sections = [8 * len(local), _aligned(4 * sum(counts))]
    sections += [_aligned(c * dtype.itemsize) for c, (_, _, dtype, _, _) in zip(counts, local, strict=True)]
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([sum(sections)], dtype=torch.int64, device=device))
    mine = torch.empty(int(max(int(t) for t in sizes)), dtype=torch.uint8, device=device)  # padding unread
    mine[:sections[0]].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
    at = sections[0]
    for _, _, _, positions, _ in local:
        mine[at:at + 4 * positions.numel()].view(torch.int32).copy_(positions)
        at += 4 * positions.numel()
    at = sections[0] + sections[1]
    for (_, _, dtype, _, values), size in zip(local, sections[2:], strict=True):
        mine[at:at + values.numel() * dtype.itemsize].view(dtype).copy_(values.reshape(-1))
        at += size
    into = [torch.empty_like(mine) for _ in range(world)] if rank() == src else None
    dist.gather(mine, into, dst=src)
    if into is None:
        return []
    n = len(local)
    cuts = []  # each rank's counts, positions and the start of its values
    for buf in into:
        k = buf[:8 * n].view(torch.int64).tolist()
        cuts.append((k, buf[8 * n:8 * n + 4 * sum(k)].view(torch.int32), 8 * n + _aligned(4 * sum(k))))
    patches = []
    pos_at = [0] * world
    val_at = [c[2] for c in cuts]
    for i, (name, shape, dtype, _, _) in enumerate(local):
        pos, vals = [], []
        for r, ((k, positions, _), buf) in enumerate(zip(cuts, into, strict=True)):
            c = k[i]
            if c:
                pos.append(positions[pos_at[r]:pos_at[r] + c])
                vals.append(buf[val_at[r]:val_at[r] + c * dtype.itemsize].view(dtype))
            pos_at[r] += c
            val_at[r] += _aligned(c * dtype.itemsize)
        if not pos:
            continue
        joined, joined_values = torch.cat(pos), torch.cat(vals)
        # Each rank's positions ascend; joined in rank order they ascend too unless the ranks' parts interleave
        # (blocks, experts, permuted rows): then sorted.
        if any(int(a[-1]) >= int(b[0]) for a, b in zip(pos, pos[1:], strict=False)):
            order = joined.argsort()
            joined, joined_values = joined[order], joined_values[order]
        patches.append(SparsePatch(name, joined, joined_values, shape))
    return patches


def _nan_in(patches: list[SparsePatch]) -> str | None:
    """Why the engine would refuse these patches (None: it would not): vLLM's sparse patches take NaN to mean an
    unchanged position, so its loader refuses a NaN value; said here with the tensor's name, before anything of
    this bucket is sent."""
    for p in patches:
        if p.values.is_floating_point() and bool(torch.isnan(p.values).any()):
            return (f"{p.name} holds NaN values, which vLLM's sparse patches reserve for unchanged positions (its "
                    "engine refuses them): the weights went NaN in training; nothing of this bucket was sent")
    return None


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def _buckets(diffs: list[Change], limit: int) -> Iterator[list[Change]]:
    """The Hub tensors' changes in runs of at most ``limit`` bytes of the tensors themselves (the same cut on
    every rank, whatever changed)."""
    run: list[Change] = []
    size = 0
    for change in diffs:
        run.append(change)
        size += math.prod(change.shape) * change.dtype.itemsize
        if size >= limit:
            yield run
            run, size = [], 0
    if run:
        yield run


def _patch(p: SparsePatch) -> Any:
    """vLLM's own patch class where vLLM is installed (its validation reads the same fields)."""
    cls = _vllm_patch()
    return p if cls is None else cls(p.name, p.indices, p.values, p.full_shape)


@functools.cache
def _vllm_patch() -> Any:
    try:
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch
    except Exception:  # vLLM absent, or too old for sparse updates: the fields are the same
        return None
    return SparseWeightPatch


def _attempt(fn: Callable[..., Any], *args: Any) -> str | None:
    try:
        fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
