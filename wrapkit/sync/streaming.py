"""``stream_full_parameters``: the full weights in buckets, for feeding an inference engine.

The parameters are cut into buckets of about ``bucket_bytes``, planned from their full shapes
before anything is gathered, so every rank cuts them alike. Each bucket's parameters are whole
``gather_units`` of the backend, gathered in one collective (``gather_many``), converted, and
packed end to end into one flat byte tensor. Beyond its shards a rank holds the collective's
buffer and the bucket being packed; the bucket yielded before is the consumer's to drop.

With ``merge_adapters`` each LoRA layer's base weight and adapters go into the same bucket and
are folded there (``lora_fold_stream``), one layer at a time: the whole merged model never
exists anywhere. Backends whose layout ``gather_many`` cannot serve (FSDP1 with
``use_orig_params=False``, NO_SHARD or CPU offload) are read through ``gather_each``, one
parameter or unit per collective, and cut into buckets the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._agree import Call, enter
from .._errors import ArgumentError, WrapkitError
from ..adapters.stages.plan import layout_of, state_hooks
from ..exchange.state_dict import joined_fold_plan, lora_fold_plan
from ..layers.lora_fold import LoraFoldPlan, lora_fold_stream, lora_layer_keys

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

from .._results import Bucket, BucketEntry, entry_bytes, entry_view

__all__ = ["Bucket", "BucketEntry", "stream_full_parameters", "DEFAULT_BUCKET_BYTES", "LAYOUTS"]

DEFAULT_BUCKET_BYTES = 512 * 2**20
# The names and tensors a stream gives: the Hub's (what engines' ``load_weights`` and checkpoints take),
# or the runtime module's (what a module of the same class loads as it is).
LAYOUTS = ("hub", "runtime")
# Every tensor starts on a 64-byte boundary of the bucket: any dtype can be viewed there, and
# device copies out of it are aligned.
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(items: Iterable[tuple[str, tuple[int, ...], torch.dtype, int]]) -> tuple[list[BucketEntry], int]:
    """Entries for ``(name, shape, dtype, key)`` items, one slot per key (tied names share it)."""
    entries: list[BucketEntry] = []
    at: dict[int, int] = {}
    total = 0
    for name, shape, dtype, key in items:
        if key not in at:
            at[key] = total
            total += _aligned(math.prod(shape) * dtype.itemsize)
        entries.append(BucketEntry(name, shape, dtype, at[key]))
    return entries, total


def _pack(pending: list[tuple[str, torch.Tensor]], out_dtype: Callable[[str, torch.dtype], torch.dtype],
          device: torch.device) -> Bucket:
    """One bucket of ``pending`` tensors, each converted to its ``out_dtype``."""
    entries, total = _layout((n, tuple(t.shape), out_dtype(n, t.dtype), id(t)) for n, t in pending)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for (_, t), e in zip(pending, entries, strict=True):
            entry_view(flat, e).copy_(t)
    return Bucket(flat, entries)


def _problem(bucket_bytes: object, dtype: object, merge_adapters: object, keep_dtype: object,
             dst_rank: object, layout: object = "hub") -> str | None:
    """What is wrong with the arguments on this rank, or None."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if layout not in LAYOUTS:
        return f"layout={layout!r}: pass 'hub' (the checkpoint's names and tensors) or 'runtime' (the module's)"
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        return f"bucket_bytes={bucket_bytes!r}: pass a positive int (bytes), e.g. 512 * 2**20"
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return f"dtype={dtype!r}: pass None (each parameter's own dtype) or a floating torch.dtype"
    if not isinstance(merge_adapters, bool):
        return f"merge_adapters={merge_adapters!r}: pass True or False"
    if keep_dtype is not None and not callable(keep_dtype):
        return f"keep_dtype={keep_dtype!r}: pass None or a callable taking a parameter name"
    if dst_rank is not None and (isinstance(dst_rank, bool) or not isinstance(dst_rank, int)
                                 or not 0 <= dst_rank < world):
        return f"dst_rank={dst_rank!r}: pass None (every rank) or a global rank in 0..{world - 1}"
    return None


def stream_full_parameters(wm: Adapter, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                           merge_adapters: bool = False, *, keep_dtype: Callable[[str], bool] | None = None,
                           dst_rank: int | None = None, layout: str = "hub") -> Iterator[Bucket]:
    """Buckets of the full parameters; see ``WrappedModel.stream_full_parameters``. A parameter that
    ``named_live`` does not name (the PEFT view's adapters) is gathered with its unit and left out."""
    problem = _problem(bucket_bytes, dtype, merge_adapters, keep_dtype, dst_rank, layout)
    plan, refused = None, None
    if problem is None and merge_adapters:
        try:
            plan = lora_fold_plan(wm)
        except WrapkitError as exc:  # raised after the entry, on every rank alike
            refused = exc
    call = Call.of("stream_full_parameters", bucket_bytes=bucket_bytes, dtype=str(dtype),
                   merge_adapters=merge_adapters, keep_dtype=keep_dtype is not None, dst_rank=dst_rank,
                   layout=str(layout))
    [bad] = enter(call, wm, flags=[problem is not None], invalid=1)
    if bad:
        raise ArgumentError(f"stream_full_parameters() got an argument it does not take on at least one rank "
                            f"(this rank: {problem or 'none'}); pass the same valid arguments on every rank")
    if merge_adapters:
        plan = joined_fold_plan(wm, plan, refused)  # raises a refusal on every rank (and stage) alike
    assert isinstance(bucket_bytes, int)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine = dst_rank is None or dst_rank == me

    def out_name(name: str) -> str | None:
        return plan.rename(name) if plan is not None else name

    def out_dtype(name: str, own: torch.dtype) -> torch.dtype:
        if dtype is None or not own.is_floating_point or (keep_dtype is not None and keep_dtype(name)):
            return own
        return dtype

    # The Hub's names and tensors where the names are the base model's (merged, or without PEFT); else the
    # module's own state-dict names (its hooks').
    hub: Any = layout_of(wm) if layout == "hub" and (
        plan is not None or wm.merge_root() is None) else None
    if hub is None:
        hub = state_hooks(wm, plan is not None)

    def converted(values: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(values) if hub is None else hub.export(values)

    units = wm.gatherer.units()
    if units is None:
        feed = _Feed(lora_fold_stream(plan, wm.gatherer.each()))
        fused = getattr(hub, "fused_group", None)
        yield from _from_each(wm, bucket_bytes, feed, converted(feed), out_dtype, mine, fused)
        return
    names: dict[int, list[str]] = {}
    for n, p in wm.named_live(buffers=False):
        names.setdefault(id(p), []).append(n)
    shapes = wm.weights.full_shapes()
    for bucket in _plan(units, names, shapes, plan, bucket_bytes, out_name, out_dtype):
        items = [(new, shapes.get(id(p), tuple(p.shape)), out_dtype(new, p.dtype), id(p))
                 for p in bucket for n in names.get(id(p), ()) if (new := out_name(n)) is not None]
        entries, total = _layout(items)
        values = wm.gatherer.many(bucket)
        if not mine:
            for _ in values:  # the collective, and nothing kept
                pass
            continue
        if hub is not None:  # tensors converted to the checkpoint's, packed as they come
            runtime = lora_fold_stream(plan, ((n, full) for p, full in values for n in names.get(id(p), ())))
            yield _pack(list(hub.export(runtime)), out_dtype, wm.device)
            continue
        flat = torch.empty(total, dtype=torch.uint8, device=wm.device)
        slots = {e.name: e for e in entries}
        filled: set[int] = set()
        with torch.no_grad():
            for name, value in lora_fold_stream(plan, ((n, full) for p, full in values for n in names.get(id(p), ()))):
                e = slots[name]
                # Tied names share one slot, filled once. An empty tensor takes no bytes: its offset is the next
                # tensor's, which must not be taken for filled.
                if entry_bytes(e) and e.offset not in filled:
                    entry_view(flat, e).copy_(value)
                    filled.add(e.offset)
        assert filled == {e.offset for e in entries if entry_bytes(e)}, "a planned tensor never came"
        yield Bucket(flat, entries)
        del flat


def _plan(units: list[list[torch.nn.Parameter]], names: dict[int, list[str]], shapes: dict[int, tuple[int, ...]],
          plan: LoraFoldPlan | None, bucket_bytes: int, out_name: Callable[[str], str | None],
          out_dtype: Callable[[str, torch.dtype], torch.dtype]) -> Iterator[list[torch.nn.Parameter]]:
    """The parameters of each bucket: whole units, a LoRA layer's units always together, packed in
    order while the gathered bytes and the packed bytes both stay within ``bucket_bytes`` (a group
    bigger than that is a bucket of its own)."""
    # Union of the units that hold parts of one LoRA layer (base weight and adapters).
    layer_of = lora_layer_keys(plan)
    root = list(range(len(units)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    first_unit: dict[str, int] = {}
    for i, unit in enumerate(units):
        for p in unit:
            for n in names.get(id(p), []):
                layer = layer_of.get(n)
                if layer is not None:
                    j = first_unit.setdefault(layer, i)
                    root[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(units)):
        groups.setdefault(find(i), []).append(i)

    def cost(params: list[torch.nn.Parameter]) -> int:
        gathered = packed = 0
        for p in params:
            numel = math.prod(shapes.get(id(p), tuple(p.shape)))
            gathered += numel * p.dtype.itemsize
            outs = [new for n in names.get(id(p), []) if (new := out_name(n)) is not None]
            if outs:
                packed += _aligned(numel * out_dtype(outs[0], p.dtype).itemsize)
        return max(gathered, packed)

    bucket: list[torch.nn.Parameter] = []
    size = 0
    for members in sorted(groups.values(), key=lambda m: m[0]):
        params = [p for i in members for p in units[i]]
        c = cost(params)
        if bucket and size + c > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += params
        size += c
    if bucket:
        yield bucket


class _Feed:
    """An iterator that counts the values taken from it: what a converter yields between two takes came from
    the same values (the pieces one runtime tensor is cut into, in the Hub's layout)."""

    def __init__(self, values: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.values, self.taken = values, 0

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        self.taken += 1
        return next(self.values)


def _same_source(feed: _Feed, values: Iterator[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``values`` in groups, each the pieces converted from the same runtime values (``feed``'s takes)."""
    group: list[tuple[str, torch.Tensor]] = []
    source = -1
    for name, value in values:
        if feed.taken != source and group:  # a new runtime value: the last one's pieces are complete
            yield group
            group = []
        source = feed.taken
        group.append((name, value))
    if group:
        yield group


def _fused_runs(groups: Iterator[list[tuple[str, torch.Tensor]]],
                fused: Callable[[str], str | None] | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``groups``, with consecutive ones that a receiver fuses into one tensor (``fused``: the same group name,
    a layer's experts in a layout that keeps them apart) joined."""
    run: list[tuple[str, torch.Tensor]] = []
    key: str | None = None
    for group in groups:
        mine = fused(group[0][0]) if fused is not None else None
        if run and (mine is None or mine != key):
            yield run
            run = []
        run.extend(group)
        key = mine
    if run:
        yield run


def _from_each(wm: Adapter, bucket_bytes: int, feed: _Feed, values: Iterator[tuple[str, torch.Tensor]],
               out_dtype: Callable[[str, torch.dtype], torch.dtype], mine: bool,
               fused: Callable[[str], str | None] | None = None) -> Iterator[Bucket]:
    """Buckets cut from a ``gather_each`` stream, for layouts ``gather_many`` does not serve. The tensors converted
    from the same runtime values stay in one bucket, as they do from whole units: a receiver loading bucket by
    bucket (vLLM's ``load_weights``) must get every piece of a fused tensor together."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def pack(entries: list[tuple[str, torch.Tensor]]) -> Bucket:
        return _pack(entries, out_dtype, wm.device)

    for group in _fused_runs(_same_source(feed, values), fused):
        if not mine:
            continue
        group_size = sum(_aligned(value.numel() * max(value.element_size(), out_dtype(name, value.dtype).itemsize))
                         for name, value in group)
        if pending and size + group_size > bucket_bytes:
            yield pack(pending)
            pending, size = [], 0
        pending, size = pending + group, size + group_size
    if pending:
        yield pack(pending)
