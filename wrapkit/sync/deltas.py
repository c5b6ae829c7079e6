"""Each rank's own weights diffed against its snapshot, before anything is gathered (``DeltaSync``'s sparse rounds).

A rank reads the part of every parameter it holds (``Weights.pieces``: an FSDP1 flat-parameter slice, a DTensor
shard or block, a ZeRO-3 partition, a whole tensor), keeps the share no other rank keeps of it (replicas split
their part evenly: DDP, HSDP, a parameter tensor parallelism leaves whole), and compares it bit for bit, in the
wire dtype, with its snapshot of the same elements (``changes``). The changed elements go to the Hub's tensors and
positions through the index map ``hub_map`` learns once from the model's own export; where that map is refused
(a Hub tensor computed from the parameters) the caller gathers and diffs as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .changes import changed, commit, take
from .hub_map import HubOrder, Target, hub_targets

__all__ = ["ShardDiff", "Change"]


class Change(NamedTuple):
    """This rank's changes of one Hub tensor: flat positions (int64, in the Hub tensor) and their values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor


class _Held(NamedTuple):
    """The elements of one parameter this rank diffs: ``read()`` gives them (1-D, the live values), ``where(i)``
    the flat positions in the parameter of the ones at ``i`` (int64; ascending with ``i``), ``wire`` the dtype
    they travel in, ``part`` the piece they come from (``(name, start, numel, box)``: equal on the ranks that
    hold the same elements)."""

    name: str
    read: Callable[[], torch.Tensor]
    where: Callable[[torch.Tensor], torch.Tensor]
    numel: int
    wire: torch.dtype
    part: tuple[Any, ...]


class ShardDiff:
    """This rank's share of the weights in the wire dtype, its snapshot, and its changes in the Hub's coordinates.

    ``plan()`` (collective, once) says why the model cannot be diffed so, or None; ``take()`` snapshots the share
    (after a dense round); ``diff()`` gives the changes since, by Hub tensor in the Hub stream's order, the same
    names on every rank; ``commit()`` takes them into the snapshot once the send succeeded."""

    def __init__(self, wm: Any, dtype: torch.dtype | None, keep_dtype: Callable[[str], bool] | None,
                 device: torch.device) -> None:
        self.wm, self.dtype, self.keep_dtype, self.device = wm, dtype, keep_dtype, device
        self.reason: str | None = None
        self._planned = False
        self._held: list[_Held] = []
        self._targets: list[Target | None] = []  # by held part
        self.hub_order: HubOrder = []
        self._snapshot: list[torch.Tensor] = []
        self._pending: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []  # (part, where or all, values)

    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._snapshot)

    # -- the plan, once ---------------------------------------------------------------------------------
    def plan(self) -> str | None:
        """Why this model's weights cannot be diffed on the ranks (the same on every rank), or None. Collective
        the first time."""
        if not self._planned:
            reason, held = self._local_reason(), []
            if reason is None:
                try:
                    held = self._own_parts()
                except _Refused as exc:
                    reason = str(exc)
            # Every rank's parts, to split those that several ranks hold alike.
            metas = _everyone((reason, [h.part for h in held]))
            reason = next((r for r, _ in metas if r is not None), None) or _overlapping([m for _, m in metas])
            if reason is None:
                self._held = _split_replicas(held, [m for _, m in metas])
                reason = self._map_to_hub()
            self.reason, self._planned = reason, True
            if reason is not None:
                self._held, self._targets, self.hub_order = [], [], []
        return self.reason

    def _local_reason(self) -> str | None:
        from .._errors import WrapkitError
        from .._registry import as_adapter

        try:
            wm = self.wm = as_adapter(self.wm, "a delta sync diffed on the ranks")
        except WrapkitError as exc:  # a view over another model
            return str(exc)
        if wm.merge_root() is not None:
            return "a PEFT model: its tensors are gathered (merged LoRA changes the whole merged weight)"
        return None

    def _agreed_order(self, reason: str | None, dests: dict[str, tuple[str, ...]]) -> str | None:
        """Every rank's outcome of the Hub map, and one order of the Hub's tensors for all: each rank's own
        (a pipeline stage exports its own tensors), joined in rank order. Refused: a tensor the ranks export
        with different shapes or dtypes; a parameter name whose elements go to different Hub tensors on different
        ranks (not one parameter: local experts named alike); a Hub tensor that ranks export from different
        parameters (two stages each exporting a tied weight would send it twice)."""
        every = _everyone((reason, self.hub_order, dests))
        refused = next((str(r) for r, _, _ in every if r is not None), None)
        if refused is not None:
            return refused
        order: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for _, hub, _ in every:
            for name, shape, dtype in hub:
                if order.setdefault(name, (shape, dtype)) != (shape, dtype):
                    return f"the ranks export the Hub's {name} with different shapes or dtypes"
        goes: dict[str, tuple[str, ...]] = {}
        comes: dict[str, set[str]] = {}
        for rank, (_, _, mine) in enumerate(every):
            sources: dict[str, set[str]] = {}
            for param, hubs in mine.items():
                if goes.setdefault(param, hubs) != hubs:
                    return f"the ranks' {param} are not one tensor: they go to different Hub tensors"
                for hub_name in hubs:
                    sources.setdefault(hub_name, set()).add(param)
            for hub_name, params in sources.items():
                if comes.setdefault(hub_name, params) != params:
                    return (f"the ranks export the Hub's {hub_name} from different tensors (rank {rank}: "
                            f"{sorted(params)})")
        self.hub_order = [(name, shape, dtype) for name, (shape, dtype) in order.items()]
        return None

    def _own_parts(self) -> list[_Held]:
        out = []
        for piece in self.wm.weights.pieces():
            readable = piece.live is not None or (piece.source is not None and piece.values is not None)
            if not readable or (piece.columns is not None and piece.box is None):
                raise _Refused(f"this rank's part of {piece.name} cannot be read where it lies")
            read = _reader(piece)
            local = read()
            part = (piece.name, piece.start, piece.numel, piece.box)
            out.append(_Held(piece.name, read, _positions(piece, 0), local.numel(), self._wire(piece.name, local.dtype),
                             part))
        return out

    def _wire(self, name: str, own: torch.dtype) -> torch.dtype:
        if self.dtype is None or not own.is_floating_point or (self.keep_dtype is not None and self.keep_dtype(name)):
            return own
        return self.dtype

    def _map_to_hub(self) -> str | None:
        """Each held parameter's Hub target, and the Hub's tensors this rank exports; the reason where some Hub
        tensor is computed rather than picked."""
        held: list[tuple[str, Callable[[], torch.Tensor]]] = [
            (h.name, functools.partial(h.where, torch.arange(h.numel))) for h in self._held]
        found = hub_targets(self.wm, held, self._wire)
        self.hub_order, self._targets = found.order, found.targets
        return self._agreed_order(found.reason, found.dests)

    # -- the rounds -------------------------------------------------------------------------------------
    def take(self) -> None:
        """Snapshot this rank's share as it is now (after a dense round the engine holds it)."""
        self._snapshot = [h.read().to(h.wire).to(self.device, copy=True) for h in self._held]
        self._pending = []

    def diff(self) -> list[Change]:
        """This rank's changes since the snapshot, one entry per Hub tensor (possibly empty), in ``hub_order``."""
        got: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {n: ([], []) for n, _, _ in self.hub_order}
        mixed: set[str] = set()  # Hub tensors whose positions come from several parts, or permuted: sorted
        self._pending = []
        for i, h in enumerate(self._held):
            live = h.read()
            now = live.to(h.wire).to(self.device)
            where = changed(now, self._snapshot[i])
            if not where.numel():
                continue
            values = take(now, where)
            if 5 * where.numel() <= now.numel():
                self._pending.append((i, where, values))
            else:  # most of it changed: the whole share becomes the snapshot (smaller than positions, no scatter)
                fresh = now.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
                self._pending.append((i, None, now if fresh else now.clone()))
            target = self._targets[i]
            if target is None:
                continue
            if target.hub is not None:
                if got[target.hub][0]:
                    mixed.add(target.hub)
                got[target.hub][0].append(h.where(where))
                got[target.hub][1].append(values)
                continue
            assert target.which is not None and target.at is not None
            which, at = target.which[where], target.at[where].to(torch.int64)
            for k, hub_name in enumerate(target.names):
                mask = which == k
                got[hub_name][0].append(at[mask])
                got[hub_name][1].append(values[mask])
                mixed.add(hub_name)
        out = []
        for name, shape, dtype in self.hub_order:
            pos, vals = got[name]
            positions = torch.cat(pos) if len(pos) > 1 else pos[0] if pos else torch.zeros(0, dtype=torch.int64)
            values = torch.cat(vals) if len(vals) > 1 else vals[0] if vals else torch.zeros(0, dtype=dtype)
            if name in mixed:
                order = positions.argsort()
                positions, values = positions[order], values[order]
            out.append(Change(name, shape, dtype, positions, values))
        return out

    def commit(self) -> None:
        """Take the last ``diff()``'s changes into the snapshot (every rank, once the send succeeded)."""
        commit(self._snapshot, self._pending)
        self._pending = []


class _Refused(Exception):
    pass


def _everyone(value: Any) -> list[Any]:
    """``value`` as each rank has it, in rank order."""
    if not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _reader(piece: Any) -> Callable[[], torch.Tensor]:
    if piece.live is not None:
        live: Callable[[], torch.Tensor] = piece.live
        return lambda: live().detach().reshape(-1)
    values, source = piece.values, piece.source
    return lambda: values(source).detach().reshape(-1)


def _positions(piece: Any, lo: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The flat positions in the full parameter of a piece's elements ``lo + i`` (its values' order)."""
    if piece.box is None:
        start = piece.start + lo
        return lambda i: i + start
    offsets, sizes = piece.box
    full = piece.full_shape

    def where(i: torch.Tensor) -> torch.Tensor:
        j, out, stride = i + lo, torch.zeros_like(i), 1
        for dim in reversed(range(len(sizes))):  # row-major in the block and in the whole: ascending with i
            out += (j % sizes[dim] + offsets[dim]) * stride
            j = j // sizes[dim]
            stride *= full[dim]
        return out

    return where


def _overlapping(every: list[list[tuple[Any, ...]]]) -> str | None:
    """Where two ranks hold parts of a parameter that overlap without being the same part (replicas split
    their part; anything else would send an element twice)."""
    by_name: dict[str, set[tuple[Any, ...]]] = {}
    for parts in every:
        for part in parts:
            by_name.setdefault(part[0], set()).add(part)
    for name, held in by_name.items():
        ranges = sorted((p[1], p[1] + p[2]) for p in held if p[3] is None)
        boxes = [p[3] for p in held if p[3] is not None]
        if ranges and boxes:
            return f"the ranks hold {name} in ranges and in blocks at once"
        if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False)):
            return f"the ranks' ranges of {name} overlap"
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1],
                                                                                 strict=True)):
                    return f"the ranks' blocks of {name} overlap"
    return None


def _split_replicas(held: list[_Held], every: list[list[tuple[Any, ...]]]) -> list[_Held]:
    """Where several ranks hold the same part of a parameter, each keeps an even share of it."""
    me = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for h in held:
        holders = [r for r, parts in enumerate(every) if h.part in parts]
        k, n = holders.index(me), len(holders)
        lo, hi = h.numel * k // n, h.numel * (k + 1) // n
        if lo == hi:
            continue
        out.append(_Held(h.name, _sliced(h.read, lo, hi), _shifted(h.where, lo), hi - lo, h.wire, h.part))
    return out


def _shifted(where: Callable[[torch.Tensor], torch.Tensor], lo: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda i: where(i + lo)


def _sliced(read: Callable[[], torch.Tensor], lo: int, hi: int) -> Callable[[], torch.Tensor]:
    return lambda: read()[lo:hi]
