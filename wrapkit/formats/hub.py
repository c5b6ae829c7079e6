"""The Hub's layout of a model's weights beside its runtime layout, both ways.

transformers 5 holds many models in a *runtime* layout that differs from the *checkpoint* layout on
the Hub: experts fused into 3-D parameters, vision-language prefixes moved, tied weights stored
once. It converts whenever it loads (``from_pretrained`` applies a conversion mapping and records it
on the model as ``_weight_conversions``) or saves (``save_pretrained`` reverts it and drops the tied
copies). ``HubLayout`` reads that knowledge from the installed transformers, never from a table of
ours: the conversions the model was loaded with, else transformers' default mapping for its type,
and the model's own tie map. Exports run the reverted conversions over a stream of runtime
tensors, one group at a time; imports say, for each runtime name, which checkpoint tensors build it
and how, reading only the rows asked for where the conversion stacks experts along the first
dimension.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from .._imports import lookup
from ..base.module_internals import recorded_conversions

__all__ = ["HubLayout", "Converted", "Layout", "hub_tensors"]

Entries = Mapping[str, tuple[tuple[int, ...], str]]
Reader = Callable[[str], torch.Tensor]


class Layout(Protocol):
    """What exports and loads use of a model's Hub layout: transformers' (``HubLayout``), or one a backend
    defines for its own fused layers (``formats.megatron.MegatronLayout``)."""

    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]: ...

    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]: ...

    def optional(self) -> frozenset[str]: ...


def _materialized(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, list) else value  # type: ignore[no-any-return]


class Converted:
    """One runtime tensor built by a conversion from checkpoint tensors (``sources``: per source
    pattern, the checkpoint keys in transformers' order)."""

    def __init__(self, layout: HubLayout, name: str, group: str, converter: Any,
                 sources: dict[str, list[str]], shape: tuple[int, ...] | None = None) -> None:
        self.layout, self.name, self.group, self.converter, self.sources = layout, name, group, converter, sources
        self.shape = shape  # what the sources make, worked out on the meta device; None where they do not convert

    def keys(self) -> list[str]:
        return [k for keys in self.sources.values() for k in keys]

    def run(self, tensor_of: Callable[[str], torch.Tensor], rows: slice | None = None) -> dict[str, torch.Tensor]:
        """The conversion's outputs from ``tensor_of(key)`` of each source (``rows`` of each source list)."""
        conv = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in keys[rows] if rows is not None else keys:
                conv.add_tensor(self.group, key, pattern, tensor_of(key))  # a tensor serves for a future
        model = self.layout.model
        out = conv.convert(self.group, model=model, config=getattr(model, "config", None))
        return {k: _materialized(v) for k, v in out.items()}

    def shapes(self, meta: Reader) -> dict[str, tuple[int, ...]] | None:
        """The runtime shapes the sources make, worked out on the meta device (``meta(key)``: a
        source as a meta tensor); None where they do not convert (shapes that disagree, a missing
        expert, too few sources yet)."""
        try:
            return {name: tuple(t.shape) for name, t in self.run(meta).items()}
        except Exception:  # transformers' ops raise what torch raises on shapes that do not fit
            return None

    def stacks_rows(self) -> bool:
        """Whether row ``i`` of the result comes from the ``i``-th key of each source alone: the
        conversion first stacks a list along dimension 0 and then only joins along other dimensions."""
        ops = getattr(self.converter, "operations", [])
        merge = lookup("transformers.core_model_loading", "MergeModulelist")
        concat = lookup("transformers.core_model_loading", "Concatenate")
        if not ops or merge is None or not isinstance(ops[0], merge) or getattr(ops[0], "dim", None) != 0:
            return False
        return all(concat is not None and isinstance(op, concat) and getattr(op, "dim", 0) != 0 for op in ops[1:])

    def rows(self, read: Reader, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` of a runtime tensor that ``stacks_rows``, read from their sources alone."""
        return self.run(read, slice(first, last))[self.name]

    def full(self, read: Reader) -> torch.Tensor:
        return self.run(read)[self.name]


# transformers' default mapping of each model, looked up once: the look-up walks every module (and under
# FSDP2 builds a skeleton on the meta device), which a weight sync every few steps would repeat. Weak on the
# model: the mapping holds patterns, not the model, so an entry keeps nothing alive.
_DEFAULTS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def _default_conversions(model: Any, base: type) -> list[Any]:
    """transformers' default conversions for ``model``, as its own save reverts them for a model built
    from a config: no legacy renames, and no prefix change (nothing says the prefix was there)."""
    found = _DEFAULTS.get(model)
    if found is None:
        found = _DEFAULTS[model] = _look_up_conversions(model, base)
    return found


def _look_up_conversions(model: Any, base: type) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # a transformers without conversions: the layouts coincide
        return []
    if any(isinstance(m, base) and _fsdp_class(type(m)) for m in model.modules()):
        # transformers looks mappings up by class name, and FSDP2 renames the classes it shards
        # (FSDPQwen2VL...): the lookup runs on a skeleton of the model's own class on the meta device.
        own = next(c for c in type(model).__mro__ if not _fsdp_class(c))
        with torch.device("meta"):
            model = own(copy.deepcopy(model.config))
    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def _fsdp_class(cls: type) -> bool:
    return cls.__module__.startswith("torch.distributed.fsdp")


class HubLayout:
    """The conversions between one transformers model's runtime names and tensors and the Hub's."""

    def __init__(self, model: torch.nn.Module, conversions: list[Any], tied: Mapping[str, str]) -> None:
        self.model = model
        self.conversions = conversions
        self.tied = dict(tied)  # runtime target -> the runtime name it is tied to
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        reverse = [c.reverse_transform() for c in conversions[::-1]]
        self._out_renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
        self._out_converters = [c for c in reverse if isinstance(c, WeightConverter)]
        self._out_by_pattern = {p: c for c in self._out_converters for p in c.source_patterns}
        self._in_renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        self._in_converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._in_by_pattern = {p: c for c in self._in_converters for p in c.source_patterns}

    @staticmethod
    def of(model: torch.nn.Module, tied: Mapping[str, str] | None = None) -> HubLayout | None:
        """The layout of ``model`` (the innermost model, PEFT layers peeled), or None when it is not a
        transformers model or its layouts coincide. ``tied``: the tie map, where the model's own is not the
        whole model's (a pipeline stage's)."""
        base = lookup("transformers.modeling_utils", "PreTrainedModel")
        if base is None or not isinstance(model, base):
            return None
        pretrained: Any = model
        conversions = recorded_conversions(model)
        if conversions is None:
            conversions = _default_conversions(pretrained, base)
        if tied is None:
            tied = getattr(model, "all_tied_weights_keys", None) or {}
        if not conversions and not tied:
            return None
        return HubLayout(pretrained, list(conversions), tied)

    # -- runtime -> checkpoint ------------------------------------------------------------
    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's ``(name, tensor)`` for a stream of runtime ones: tied copies left out,
        renamed, converted per group as soon as a group's runtime tensors are all in (a tensor
        waiting for the rest of its group is copied, since a gather may reuse its storage)."""
        waiting: dict[str, tuple[Any, set[str]]] = {}
        for name, tensor in entries:
            if name in self.tied:
                continue
            group, pattern = _converted_name(name, self._out_converters)
            if pattern is None:
                yield _renamed(name, self._out_renamings), tensor
                continue
            conv, seen = waiting.get(group) or (copy.deepcopy(self._out_by_pattern[pattern]), set())
            seen.add(pattern)
            complete = len(seen) == len(conv.source_patterns)
            value: Any = tensor if complete else tensor.clone()  # a tensor serves for a future
            conv.add_tensor(group, name, pattern, value)
            if not complete:
                waiting[group] = (conv, seen)
                continue
            waiting.pop(group, None)
            out = conv.convert(group, model=self.model, config=getattr(self.model, "config", None))
            for target, value in out.items():
                yield _renamed(target, self._out_renamings), _materialized(value)
        if waiting:
            raise ValueError(f"runtime tensors of {sorted(waiting)[:3]} came without the rest of their group")

    # -- checkpoint -> runtime --------------------------------------------------------------
    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Converted]]:
        """For a checkpoint's ``entries`` and the model's ``runtime`` names: ``(renamed, converted)``,
        where ``renamed`` maps a runtime name to the one checkpoint key holding it as it is, and
        ``converted`` to the conversion that builds it (its ``shape`` None where the sources do not
        convert). A key that fits no runtime name is kept
        under its own name in ``renamed``, for the caller to report."""
        from transformers.core_model_loading import dot_natural_key

        from .safetensors import torch_dtype

        def meta(key: str) -> torch.Tensor:
            shape, dtype = entries[key]
            return torch.empty(shape, dtype=torch_dtype(dtype) or torch.float32, device="meta")

        names: dict[str, Any] = dict.fromkeys(runtime, True)
        renamed: dict[str, str] = {}
        groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        for key in sorted(entries, key=dot_natural_key):  # transformers' order: expert 10 after 9
            target, pattern = self._incoming(key, names)
            if pattern is None:
                renamed[target if target in names else key] = key
                continue
            conv, sources = groups.setdefault(target, (self._in_by_pattern[pattern], {}))
            sources.setdefault(pattern, []).append(key)
        converted: dict[str, Converted] = {}
        for group, (conv, sources) in groups.items():
            made = Converted(self, group, group, conv, sources).shapes(meta)
            if made is None:  # sources that do not convert stand under the group's name, to be reported
                converted[group] = Converted(self, group, group, conv, sources)
                continue
            for name, shape in made.items():
                converted[name] = Converted(self, name, group, conv, sources, shape)
        return renamed, converted

    def _incoming(self, key: str, names: dict[str, Any]) -> tuple[str, str | None]:
        """The runtime name a checkpoint key goes to (itself where no rule gives one of ``names``),
        and the source pattern of the conversion it feeds, if any: as transformers' load decides."""
        from transformers.core_model_loading import rename_source_key

        prefix = getattr(self.model, "base_model_prefix", None) or None
        target, pattern = rename_source_key(key, self._in_renamings, self._in_converters, prefix, names)
        if target not in names and key in names:
            return key, None
        return target, pattern

    def importer(self, shapes: Mapping[str, tuple[int, ...]]) -> Importer:
        """An ``Importer`` into a model whose runtime names have ``shapes``."""
        return Importer(self, shapes)

    def optional(self) -> frozenset[str]:
        """Runtime names a checkpoint may lack: the tied copies, rebuilt from what they are tied to."""
        return frozenset(self.tied)


def hub_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's parameters and persistent buffers in the Hub's layout (its state dict where the two
    layouts coincide), each tied weight once."""
    state = model.state_dict()
    layout = HubLayout.of(model)
    return dict(state) if layout is None else dict(layout.export(state.items()))


class Importer:
    """Checkpoint tensors arriving one at a time (a stream's buckets) turned into runtime ones: a
    renamed tensor at once, a converted one when the last of its sources is in. Sources waiting for
    the rest are copied, since a bucket's views are freed when the stream moves on."""

    def __init__(self, layout: HubLayout, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.layout, self.shapes = layout, dict(shapes)
        self.waiting: dict[str, tuple[Any, dict[str, list[tuple[str, torch.Tensor]]]]] = {}

    def feed(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        target, pattern = self.layout._incoming(key, self.shapes)
        if pattern is None:
            return [(target, tensor)]
        conv, sources = self.waiting.setdefault(target, (self.layout._in_by_pattern[pattern], {}))
        sources.setdefault(pattern, []).append((key, tensor.clone()))
        if not self._complete(target, conv, sources):
            return []
        del self.waiting[target]
        keys = {p: [k for k, _ in items] for p, items in sources.items()}
        values = {k: t for items in sources.values() for k, t in items}
        made = Converted(self.layout, target, target, conv, keys).run(values.__getitem__)
        return list(made.items())

    def _complete(self, target: str, conv: Any, sources: dict[str, list[tuple[str, torch.Tensor]]]) -> bool:
        want = self.shapes.get(target)
        if want is None or len(sources) < len(conv.source_patterns):
            return False
        keys = {p: [k for k, _ in items] for p, items in sources.items()}
        probe = Converted(self.layout, target, target, conv, keys)
        if probe.stacks_rows():  # one source per row for each pattern
            return all(len(items) == want[0] for items in sources.values())
        metas = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for items in sources.values() for k, t in items}
        made = probe.shapes(metas.__getitem__)
        return made is not None and made.get(target) == tuple(want)

    def unfinished(self) -> list[str]:
        """Runtime names whose sources did not all come."""
        return sorted(self.waiting)


# transformers' own helpers for these two appeared after 5.19 (which ms-swift 4.6 pins); each transform's
# ``rename_source_key`` is in every 5.x release.
def _renamed(name: str, renamings: list[Any]) -> str:
    """``name`` after every renaming in turn (they may chain)."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def _converted_name(name: str, converters: list[Any]) -> tuple[str, str | None]:
    """``name`` renamed by the first converter that matches it, and the source pattern it matched (None: none)."""
    for converter in converters:
        new, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return new, pattern
    return name, None
