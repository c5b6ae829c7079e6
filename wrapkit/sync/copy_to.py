"""Weight sync: ``copy_to`` between any two backends, EMA included.

Matched by canonical name. Where both models hold the same slice of every parameter on this
rank (ZeRO-3 to ZeRO-3, FSDP2 to FSDP2 over the same ranks) the sync is a local copy of the
shards, with nothing gathered; otherwise the source is streamed one full parameter at a time
into the target's write-back. Either way every problem is agreed on first (``_agree``).

A shard-to-shard pairing, once validated, is cached against a fingerprint of both layouts
(``_layout_key``): a later sync of the same pair reads no names, shapes or buffers again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._agree import Call, checking, enter, raise_agreed
from .._errors import ArgumentError
from ..adapters import Written
from ..adapters.stages.parts import stage_buffers
from ..base.module_internals import lerp_all_
from ..exchange.state_dict import Shape, assign, check_entries, expected_shapes, write

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["copy_to"]


def _alpha_problem(alpha: object) -> str | None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        return (f"alpha={alpha!r}: pass a number in [0, 1] (1 copies; below 1 is an EMA, "
                "target = alpha * source + (1 - alpha) * target)")
    return None


def _raise_bad_alpha(problem: str | None) -> None:
    raise ArgumentError(f"copy_to() got an alpha it does not take on at least one rank (this rank: "
                        f"{problem or 'fine'}); pass the same valid alpha on every rank")


def _copy_call(target: Adapter, alpha: float) -> Call:
    # The target as every rank can name it: its wrapper stack (cheap: this runs every EMA step).
    return Call.of("copy_to", target=" > ".join(target.stack), alpha=alpha)


_COPY_FIX = ("copy_to matches weights by canonical name: source and target must be the same architecture, "
             "with the same PEFT layers.")


_ITSELF = "the target is the source model itself; pass another model (e.g. the reference)"


def copy_to(source: Adapter, target: Adapter, alpha: float = 1.0, *, itself: str = _ITSELF) -> None:
    """``target = alpha * source + (1 - alpha) * target`` for every parameter and persistent buffer.

    Matched by canonical name; any backend to any backend. Integer buffers are copied.
    ``requires_grad`` and training flags of the target are not touched. ``itself``: the refusal
    when the target is the source's own model.
    """
    same = target is source or target.module is source.module
    bad_alpha = _alpha_problem(alpha)
    problems = [itself] if same else []
    cached = None if problems or bad_alpha else _cached_pairs(source, target)
    if cached is not None:
        # The pairing validated by an earlier call still holds on this rank: no names, shapes or
        # buffers to read again. The entry still agrees that it holds on every rank (and checks
        # the call), unless calls are not checked: then a same-layout sync has no collective.
        any_problem = any_bad = any_slow = False
        if checking():
            any_problem, any_bad, any_slow = enter(_copy_call(target, alpha), source, target,
                                                   flags=[False, False, False], invalid=1)
        if any_bad:
            _raise_bad_alpha(None)
        raise_agreed([], f"copy_to from {' > '.join(source.stack)} to {' > '.join(target.stack)}", _COPY_FIX,
                     source, target, agreed=any_problem)
        if any_slow:
            write(target, _source_stream(source), float(alpha))
            return
        _copy_pairs(cached, float(alpha), target)
        return
    pairs = None if problems or bad_alpha else _shard_pairs(source, target)
    if not problems and not bad_alpha:
        # Same parameter names and shard layouts imply the same shapes: then only the
        # buffers need checking, which keeps a frequent soft update cheap.
        if pairs is None:
            src: dict[str, Shape | None] = dict(expected_shapes(source))
            problems = check_entries(src, expected_shapes(target), True, ("the source", "the target"))
        else:
            src_buffers = dict(source.named_live(parameters=False))
            tgt_buffers = dict(target.named_live(parameters=False))
            problems = check_entries({n: tuple(b.shape) for n, b in src_buffers.items()},
                              {n: tuple(b.shape) for n, b in tgt_buffers.items()}, True, ("the source", "the target"))
            pairs += [(tgt_buffers[n], b) for n, b in src_buffers.items() if n in tgt_buffers]
    # One collective agrees on both: whether any rank found a problem, and whether every
    # rank can take the shard-to-shard path (which has no collective; the general one has many).
    any_problem, any_bad, any_slow = enter(_copy_call(target, alpha), source, target,
                                           flags=[bool(problems) or bad_alpha is not None, bad_alpha is not None,
                                                  pairs is None], invalid=1)
    if any_bad:
        _raise_bad_alpha(bad_alpha)
    raise_agreed(problems, f"copy_to from {' > '.join(source.stack)} to {' > '.join(target.stack)}",
                  _COPY_FIX, source, target, agreed=any_problem)
    if not any_slow:
        assert pairs is not None
        _copy_pairs(pairs, float(alpha), target)
        _remember(source, target, pairs)
        return
    write(target, _source_stream(source), float(alpha))


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], alpha: float, target: Adapter) -> None:
    # fp32 targets with fp32 sources on their device: ``dst*(1-alpha) + src*alpha`` as two fused
    # in-place passes over the whole list (``assign`` makes three passes and two temporaries per
    # tensor, and a Python round per tensor that a small model's sync is dominated by).
    fused = [(d, s) for d, s in pairs
             if alpha != 1.0 and d.dtype == s.dtype == torch.float32 and d.device == s.device]
    with torch.no_grad():
        if fused:
            dsts, srcs = [d for d, _ in fused], [s for _, s in fused]
            lerp_all_(dsts, srcs, alpha)
        done = {id(d) for d, _ in fused}
        for dst, src_tensor in pairs:  # the rest: 16-bit targets, copies, integer buffers
            if id(dst) not in done:
                assign(dst, src_tensor, alpha)
    target.weights.written(Written.SHARDS)
    target.weights.written(Written.WEIGHTS)


# source module -> {id(target module): (the target, layout key, pairs)}. Weak on the source; the
# entry holds the target's module weakly too, so a cached pairing never keeps a model alive.
_PAIRINGS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, tuple[Any, Any, list[Any]]]] = (
    weakref.WeakKeyDictionary())


def _layout_key(source: Adapter, target: Adapter) -> Any:
    """What a shard-to-shard pairing rests on, read cheaply: every shard tensor and buffer of both
    models (which object, which storage). Any parameter or buffer added, removed or replaced, or
    a shard moved (``place``, an offload, a load into new storage) changes it."""
    src, dst = source.weights.layout_tensors(), target.weights.layout_tensors()
    if src is None or dst is None:
        return None
    return tuple((id(t), t.data_ptr()) for t in src), tuple((id(t), t.data_ptr()) for t in dst)


def _cached_pairs(source: Adapter, target: Adapter) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    entry = _PAIRINGS.get(source.module, {}).get(id(target.module))
    if entry is None or entry[0]() is not target.module:
        return None
    key = _layout_key(source, target)
    return entry[2] if key is not None and key == entry[1] else None


def _remember(source: Adapter, target: Adapter, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    key = _layout_key(source, target)
    if key is None:
        return
    mine = _PAIRINGS.setdefault(source.module, {})
    tid = id(target.module)

    def forget(_: Any) -> None:  # the target is gone: so are the shards the pairing holds
        mine.pop(tid, None)
    mine[tid] = (weakref.ref(target.module, forget), key, pairs)


def _shard_pairs(source: Adapter, target: Adapter) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(target shard, source shard) for every parameter when both models hold the same slice of
    each parameter on this rank (ZeRO-3 to ZeRO-3, FSDP2 to FSDP2 over the same ranks): a sync is
    then a local copy, with nothing gathered. ``None`` when the layouts differ anywhere."""
    src, dst = source.weights.local_shards(), target.weights.local_shards()
    if src is None or dst is None or src.keys() != dst.keys():
        return None
    pairs = []
    for name, (d, d_key) in dst.items():
        s, s_key = src[name]
        if s_key != d_key or s.shape != d.shape:
            return None
        pairs.append((d, s))
    return pairs


def _source_stream(source: Adapter) -> Iterator[tuple[str, torch.Tensor]]:
    yield from source.gatherer.each()
    yield from stage_buffers(source)


