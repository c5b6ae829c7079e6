"""Where each element of a model's parameters lands in the Hub's tensors, learnt from the model's own export.

The export ``stream_full_parameters`` applies (the Hub layout, else the model's state-dict hooks) is run once on
tensors whose values are their own element numbers (float64, as the export goes: a layer at a time), so each Hub
element names the parameter element it came from. A parameter one Hub tensor holds whole and in order is a
rename; one whose elements are spread (experts split per expert, rows permuted, a fused projection split) gets a
Hub tensor and a position per element; a Hub element that is not a whole number, or repeats one, is computed from
the parameters rather than picked, and the map is refused with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from ..adapters.stages.plan import layout_of, state_hooks

__all__ = ["Target", "HubMap", "HubOrder", "hub_targets"]


class Target(NamedTuple):
    """Where a parameter's elements go in the Hub's tensors: ``hub`` one name (a rename, positions unchanged), or
    per held element an index into ``names`` and a position (``which``, ``at``: 6 bytes an element)."""

    hub: str | None
    names: list[str]
    which: torch.Tensor | None
    at: torch.Tensor | None


HubOrder = list[tuple[str, tuple[int, ...], torch.dtype]]  # the Hub's tensors: name, shape, wire dtype


class HubMap(NamedTuple):
    """``reason``: why the model's Hub tensors are not picked from its parameters (None where they are);
    ``order``: the Hub's tensors this rank exports (in the export's order); ``targets``: each held part's target
    (None: not exported), in the order given; ``dests``: for each of this rank's parameters, the Hub tensors its
    elements go to (sorted), so that ranks can check they agree on what a parameter of one name is."""

    reason: str | None
    order: HubOrder
    targets: list[Target | None]
    dests: dict[str, tuple[str, ...]]


def hub_targets(wm: Any, held: list[tuple[str, Callable[[], torch.Tensor]]],
                wire: Callable[[str, torch.dtype], torch.dtype]) -> HubMap:
    """This rank's map to the Hub (``HubMap``). ``held``: the parts of parameters this rank diffs (a parameter
    may have several), each with the flat positions of its elements (computed when needed); ``wire``: the
    dtype a parameter's values travel in."""
    hub_order: HubOrder = []
    names: dict[int, list[str]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for n, p in wm.named_live(buffers=False):
        names.setdefault(id(p), []).append(n)
        dtypes[n] = p.dtype
    shapes = wm.weights.param_shapes()
    groups = list(names.values())
    offsets, total = {}, 0
    for group in groups:
        for n in group:
            offsets[n] = total
        total += math.prod(shapes[group[0]])
    if total >= 2**53:
        return HubMap("the model has more elements than float64 numbers them exactly", [], [], {})
    # The export stream_full_parameters applies: the Hub layout, else the model's own state-dict hooks.
    hub = layout_of(wm)
    hub = hub if hub is not None else state_hooks(wm, False)
    owner = {n: g[0] for g in groups for n in g}
    starts = sorted({offsets[g[0]] for g in groups})
    first = {offsets[g[0]]: g[0] for g in groups}

    def numbered() -> Iterator[tuple[str, torch.Tensor]]:
        for group in groups:
            for n in group:
                off, shape = offsets[n], shapes[n]
                yield n, torch.arange(off, off + math.prod(shape), dtype=torch.float64).view(shape)

    exported = numbered() if hub is None else hub.export(numbered())
    found: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}  # param -> (hub, param pos, hub pos)
    for hub_name, codes in exported:
        flat = codes.detach().reshape(-1).to(torch.float64)
        if flat.numel() and (not torch.equal(flat, flat.round()) or flat.min() < 0 or flat.max() >= total):
            why = f"the Hub's {hub_name} is computed from the model's tensors, not picked from them"
            return HubMap(why, [], [], {})
        code = flat.to(torch.int64)
        if torch.unique(code).numel() != code.numel():
            return HubMap(f"the Hub's {hub_name} repeats elements of the model's tensors", [], [], {})
        # Which parameter each element came from: the last start at or below its number.
        at = torch.searchsorted(torch.tensor(starts, dtype=torch.int64), code, right=True) - 1
        slots = torch.unique(at).tolist()
        kinds = {wire(first[starts[i]], dtypes[first[starts[i]]]) for i in slots}
        if len(kinds) > 1:
            return HubMap(f"the Hub's {hub_name} joins tensors that travel in different dtypes", [], [], {})
        dtype = kinds.pop() if kinds else torch.float32
        hub_order.append((hub_name, tuple(codes.shape), dtype))
        for i in slots:
            param, mask = first[starts[i]], at.eq(i)
            found.setdefault(param, []).append((hub_name, code[mask] - starts[i], torch.nonzero(mask).flatten()))
    out: list[Target | None] = []
    for name, positions in held:
        targets = found.get(owner.get(name, name))
        if not targets:
            out.append(None)  # not exported (a tied head the Hub drops): nothing to send
            continue
        target = _target(targets, positions(), math.prod(shapes[name]))
        if target is None:
            return HubMap(f"{name} goes to more than one of the Hub's tensors", [], [], {})
        out.append(target)
    dests = {n: tuple(sorted({t[0] for t in found.get(owner[n], [])})) for n in owner}
    return HubMap(None, hub_order, out, dests)


def _target(targets: list[tuple[str, torch.Tensor, torch.Tensor]], held: torch.Tensor, numel: int) -> Target | None:
    """A held parameter's target: a rename where one Hub tensor holds all of it in order, else an index per
    held element (``held``: their flat positions); None where an element goes to two Hub tensors."""
    if len(targets) == 1:
        hub, src, dst = targets[0]
        if src.numel() == numel and torch.equal(src, dst) and torch.equal(src, torch.arange(numel)):
            return Target(hub, [hub], None, None)
    which = torch.full((numel,), -1, dtype=torch.int16 if len(targets) < 2**15 else torch.int32)
    at = torch.zeros(numel, dtype=torch.int32)
    for k, (_, src, dst) in enumerate(targets):
        if bool((which[src] >= 0).any()):
            return None
        which[src] = k
        at[src] = dst.to(torch.int32)
    # Kept for this rank's elements only; an element the Hub drops has no target (-1) and matches no name.
    return Target(None, [t[0] for t in targets], which[held], at[held])
