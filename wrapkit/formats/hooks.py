"""A module's own ``state_dict()`` names beside its parameters' names, through its state-dict hooks.

Some models keep a tensor fused at run time and split in their state dict: torchtitan's fused attention
projection holds ``wqkv`` and its ``state_dict()`` post-hook writes ``wq``, ``wk`` and ``wv``; a load
pre-hook fuses them back. ``named_parameters()`` and ``state_dict()`` then disagree on purpose, and the
state dict is the contract (what ``load_state_dict`` takes, what checkpoints hold). ``HookLayout`` runs a
module's own hooks on the full tensors of that module alone, as ``state_dict()`` and ``load_state_dict()``
would: exports group the tensors of each hooked module and run its post-hooks once the group is in; imports
run its load pre-hooks on the checkpoint's tensors under its prefix, first on the meta device to learn
which runtime tensors they make.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from .._names import canonical_name
from ..base.module_internals import live_entries, load_state_dict_pre_hooks, state_dict_hooks, state_dict_version
from .mapped import WholeBuild, row_segments

__all__ = ["HookLayout", "Chained", "StateHooks", "by_group", "group_of"]

Entries = Mapping[str, tuple[tuple[int, ...], str]]
Reader = Callable[[str], torch.Tensor]


def _own(mod: torch.nn.Module, hooks: Callable[[torch.nn.Module], list[Any]]) -> bool:
    """Whether ``mod`` has hooks of the model's own: the wrappers' (FSDP1 units, checkpoint wrappers, compiled
    modules) only add or strip their own name components, which canonical names drop."""
    if type(mod).__module__.startswith(("torch.distributed", "torch._dynamo")):
        return False
    return bool(hooks(mod))


def _outermost(model: torch.nn.Module, hooks: Callable[[torch.nn.Module], list[Any]]) -> dict[str, str]:
    """The outermost modules of ``model`` with ``hooks`` of their own: canonical prefix -> module path."""
    found: dict[str, str] = {}
    for name, mod in model.named_modules():
        prefix = canonical_name(name) + "." if name else ""
        if _own(mod, hooks) and not any(prefix.startswith(p) for p in found):
            found[prefix] = name
    return found


def group_of(name: str, member: Mapping[str, str], prefixes: Container[str]) -> str | None:
    """The group ``name`` is in: its own entry in ``member``, else the longest of its dotted prefixes that is one
    of ``prefixes``; None where neither."""
    found = member.get(name)
    if found is not None:
        return found
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i]) + "." if i else ""
        if prefix in prefixes:
            return prefix
    return None


def by_group(entries: Iterable[tuple[str, torch.Tensor]], group_of: Callable[[str], str | None],
             complete: Callable[[str, dict[str, torch.Tensor]], bool],
             made: Callable[[str, dict[str, torch.Tensor]], Iterable[tuple[str, torch.Tensor]]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """``entries`` with each group's tensors (``group_of``) replaced by what ``made`` makes of them, once the
    group is ``complete``, or its run of tensors ends, or the stream does; the others as they come. A tensor that
    waits is copied: a gather may reuse its storage."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    current: str | None = None
    for name, tensor in entries:
        prefix = group_of(name)
        if current is not None and prefix != current:
            yield from made(current, waiting.pop(current))
            current = None
        if prefix is None:
            yield name, tensor
            continue
        group = waiting.setdefault(prefix, {})
        group[name] = tensor.clone()
        current = prefix
        if complete(prefix, group):
            yield from made(prefix, waiting.pop(prefix))
            current = None
    for prefix, group in waiting.items():
        yield from made(prefix, group)


# The groups of each model, found once: a stream every few steps would walk every module again. Weak on
# the model, and by name: a hook bound to the model must not keep it alive.
_FOUND: weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict[str, str], dict[str, str]]] = \
    weakref.WeakKeyDictionary()


class HookLayout:
    """The conversions between a model's parameter names and tensors and its own ``state_dict()``'s, made by
    the state-dict hooks of its modules: on the way out each outermost module with post-hooks is a group
    (``saving``), on the way in each outermost module with load pre-hooks (``loading``)."""

    def __init__(self, model: torch.nn.Module, saving: dict[str, str], loading: dict[str, str]) -> None:
        self.saving = {prefix: model.get_submodule(name) for prefix, name in saving.items()}
        self.loading = {prefix: model.get_submodule(name) for prefix, name in loading.items()}
        self.member: dict[str, str] = {}  # runtime name -> the prefix of its saving group
        for prefix, mod in self.saving.items():
            for name, _ in live_entries(mod):
                self.member[prefix + name] = prefix
        self.size = collections.Counter(self.member.values())

    @staticmethod
    def of(model: torch.nn.Module) -> HookLayout | None:
        """The layout of ``model`` (the tree its names are relative to), or None where no module of it has
        state-dict hooks of its own."""
        found = _FOUND.get(model)
        if found is None:
            found = _FOUND[model] = (_outermost(model, state_dict_hooks), _outermost(model, load_state_dict_pre_hooks))
        return HookLayout(model, *found) if found[0] or found[1] else None

    # -- runtime -> state dict ----------------------------------------------------------------
    def saved(self, prefix: str, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What ``state_dict()`` makes of one group's full tensors (``values``, by runtime name): its modules'
        post-hooks run innermost first, as torch runs them."""
        state: dict[str, torch.Tensor] = collections.OrderedDict(values)
        for name, mod in reversed(list(self.saving[prefix].named_modules())):
            at = prefix + (canonical_name(name) + "." if name else "")
            for hook, public in state_dict_hooks(mod):
                made = hook(mod, state, at, {"version": state_dict_version(mod)})
                if made is not None and not public:
                    state = made
        return dict(state)

    def group_of(self, name: str) -> str | None:
        """The prefix of the saving group ``name`` is under (by its dotted prefixes: a merged stream's base names
        are not the PEFT model's member names), or None."""
        return group_of(name, self.member, self.saving)

    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The state dict's ``(name, tensor)`` for a stream of runtime ones. A group's tensors wait for the
        rest of the group (copied, since a gather may reuse their storage): until all its names have come, or
        the run of its tensors ends (a stream of parameters alone, or one under a merged model's names), or the
        stream does."""
        def complete(prefix: str, group: dict[str, torch.Tensor]) -> bool:
            return len(group) == self.size[prefix] and all(n in self.member for n in group)

        return by_group(entries, self.group_of, complete, lambda p, g: self.saved(p, g).items())

    # -- state dict -> runtime ----------------------------------------------------------------
    def loaded(self, prefix: str, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What ``load_state_dict()`` makes of the state-dict tensors under one group's ``prefix``: its modules'
        load pre-hooks run outermost first, as torch runs them."""
        state: dict[str, torch.Tensor] = collections.OrderedDict(values)
        missing: list[str] = []
        unexpected: list[str] = []
        errors: list[str] = []
        for name, mod in self.loading[prefix].named_modules():
            at = prefix + (canonical_name(name) + "." if name else "")
            for hook in load_state_dict_pre_hooks(mod):
                hook(state, at, {"version": state_dict_version(mod)}, True, missing, unexpected, errors)
        if errors:
            raise ValueError("; ".join(errors))
        return dict(state)

    def to_runtime(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole state dict under the runtime names (each group's load pre-hooks run on its tensors)."""
        out = dict(state)
        for prefix in self.loading:
            mine = {k: out.pop(k) for k in list(out) if k.startswith(prefix)}
            if mine:
                out.update(self.loaded(prefix, mine))
        return out

    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]:
        """As ``HubLayout.imports``: runtime name -> the one checkpoint key holding it as it is (``renamed``), or
        the build that makes it from several (``converted``, its ``shape`` None where the hooks do not make it
        from these keys). Worked out by running the load pre-hooks on the meta device."""
        from .safetensors import torch_dtype

        wanted = set(runtime)
        renamed: dict[str, str] = {}
        converted: dict[str, Any] = {}
        for key in entries:
            renamed[key] = key
        for prefix in self.loading:
            keys = [k for k in entries if k.startswith(prefix)]
            metas = {k: torch.empty(entries[k][0], dtype=torch_dtype(entries[k][1]) or torch.float32, device="meta")
                     for k in keys}
            try:
                made = self.loaded(prefix, metas)
            except Exception:  # hooks raise what torch raises on tensors that do not fit them
                continue
            used = [k for k in keys if k not in made or made[k] is not metas[k]]
            for name, tensor in made.items():
                if name in metas and tensor is metas[name]:
                    continue
                if name in wanted:
                    for k in used:
                        renamed.pop(k, None)
                    rows = self._row_map(prefix, used, entries, name, tuple(tensor.shape))
                    converted[name] = _Built(self, prefix, name, used, tuple(tensor.shape)) if rows is None \
                        else _RowBuilt(self, prefix, name, used, tuple(tensor.shape), rows)
        return renamed, converted

    def _row_map(self, prefix: str, keys: list[str], entries: Entries, name: str,
                 shape: tuple[int, ...]) -> list[tuple[str, int]] | None:
        """Which source row each row of runtime tensor ``name`` is, where the hooks only move whole rows: they
        run on probes (one column, each row holding its own number plus a half), and every row of the result
        must be one distinct probe row, unchanged. None otherwise (the tensor is then read whole)."""
        probes: dict[str, torch.Tensor] = {}
        rows: list[tuple[str, int]] = []
        for key in keys:
            own = entries[key][0]
            if not own:
                return None
            probes[key] = (torch.arange(len(rows), len(rows) + own[0], dtype=torch.float64) + 0.5).reshape(
                own[0], *[1] * (len(own) - 1))
            rows += [(key, i) for i in range(own[0])]
        try:
            made = self.loaded(prefix, probes).get(name)
        except Exception:  # a hook that needs the real columns: no row map
            return None
        if made is None or not shape or made.shape[0] != shape[0] or made.numel() != shape[0]:
            return None
        values = made.reshape(-1).tolist()
        picked = [int(v) for v in values if v - int(v) == 0.5 and 0 <= v < len(rows)]
        if len(picked) != len(values) or len(set(picked)) != len(picked):
            return None
        return [rows[i] for i in picked]

    def state_names(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The state dict's names and shapes of a model whose parameters' names have ``shapes`` (the hooks run on
        the meta device; a group whose hooks fail there keeps its own names)."""
        names = {n: s for n, s in shapes.items() if n not in self.member}
        for prefix in self.saving:
            names.update(self.group_state(prefix, shapes))
        return names

    def group_state(self, prefix: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The state dict's names and shapes that group ``prefix``'s hooks make of its tensors (``shapes``: by
        runtime name; the other groups' are not looked at), the hooks run on the meta device; the group's own
        names where they fail there."""
        metas = {n: torch.empty(s, device="meta") for n, s in shapes.items() if self.member.get(n) == prefix}
        try:
            return {n: tuple(t.shape) for n, t in self.saved(prefix, metas).items()}
        except Exception:  # hooks that need real values
            return {n: tuple(t.shape) for n, t in metas.items()}

    def importer(self, shapes: Mapping[str, tuple[int, ...]]) -> HookImporter:
        """A ``HookImporter`` into a model whose runtime names have ``shapes``."""
        return HookImporter(self, shapes)

    def optional(self) -> frozenset[str]:
        return frozenset()


class _Built(WholeBuild):
    """One runtime tensor that a group's load pre-hooks make from several checkpoint tensors, read whole."""

    def __init__(self, layout: HookLayout, prefix: str, name: str, keys: list[str], shape: tuple[int, ...]) -> None:
        super().__init__(keys, shape)
        self.layout, self.prefix, self.name = layout, prefix, name

    def full(self, read: Reader) -> torch.Tensor:
        return self.layout.loaded(self.prefix, {k: read(k) for k in self._keys})[self.name]


class _RowBuilt(_Built):
    """A ``_Built`` whose rows are rows of its sources, moved: a rank reads only the source rows of its own."""

    def __init__(self, layout: HookLayout, prefix: str, name: str, keys: list[str], shape: tuple[int, ...],
                 rows: list[tuple[str, int]]) -> None:
        super().__init__(layout, prefix, name, keys, shape)
        self._rows = rows

    def row_segments(self, first: int, last: int) -> list[tuple[str, int, int]]:
        """Rows ``[first, last)`` as ``(source key, first row, last row)`` ranges of the sources, in order."""
        return row_segments(self._rows[first:last])


class HookImporter:
    """State-dict tensors arriving one at a time (a stream's buckets) turned into runtime ones: a tensor outside
    every group at once, a group's when all the state-dict names its hooks make are in (copied while
    waiting)."""

    def __init__(self, layout: HookLayout, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.layout = layout
        self.expected: dict[str, set[str]] = {}  # prefix -> the group's state-dict names
        for prefix in layout.saving:
            metas = {n: torch.empty(s, device="meta") for n, s in shapes.items() if layout.member.get(n) == prefix}
            # The names the hooks make; the others arrive under a runtime name of their own and load as they are.
            self.expected[prefix] = {n for n in layout.saved(prefix, metas) if n not in shapes}
        self.group = {n: prefix for prefix, names in self.expected.items() for n in names}
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        prefix = self.group.get(key)
        if prefix is None:
            return [(key, tensor)]
        group = self.waiting.setdefault(prefix, {})
        group[key] = tensor.clone()
        if set(group) != self.expected[prefix]:
            return []
        return list(self.layout.loaded(prefix, self.waiting.pop(prefix)).items())

    def unfinished(self) -> list[str]:
        return sorted(self.waiting)


class StateHooks(Protocol):
    """What ``Chained`` needs of a model's hooks: ``HookLayout``, or a pipeline stage's view of every stage's."""

    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]: ...

    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]: ...

    def state_names(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]: ...

    def to_runtime(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class Chained:
    """A model's own state-dict hooks (``hooks``: its parameters' names <-> its state dict's), then the Hub's
    layout of its state dict (``outer``: transformers' conversions, or a mapping of the model's own)."""

    def __init__(self, hooks: StateHooks, outer: Any) -> None:
        self.hooks, self.outer = hooks, outer

    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return self.outer.export(self.hooks.export(entries))  # type: ignore[no-any-return]

    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]:
        """The Hub's tensors seen under the state dict's names (``outer``), then those under the parameters'
        (``hooks``); a tensor the hooks build reads its state-dict sources through ``outer``."""
        runtime = dict(runtime) if isinstance(runtime, Mapping) else dict.fromkeys(runtime, ())
        names = self.hooks.state_names(runtime)
        by_state, built = self.outer.imports(entries, names)
        state: dict[str, tuple[tuple[int, ...], str]] = {n: entries[k] for n, k in by_state.items()}
        for n, conv in built.items():
            if conv.shape is not None:
                state[n] = (conv.shape, entries[conv.keys()[0]][1])
        renamed: dict[str, str] = {}
        converted: dict[str, Any] = {n: conv for n, conv in built.items() if conv.shape is None}  # reported
        by_name, made = self.hooks.imports(state, runtime)
        for name, key in by_name.items():
            if key in by_state:
                renamed[name] = by_state[key]
            elif key in built:
                converted[name] = built[key]
        for name, conv in made.items():
            converted[name] = _Through(conv, by_state, built)
        return renamed, converted

    def optional(self) -> frozenset[str]:
        return self.outer.optional()  # type: ignore[no-any-return]

    def hub_config(self) -> Any:
        return getattr(self.outer, "hub_config", lambda: None)()

    def fused_group(self, key: str) -> str | None:
        fused = getattr(self.outer, "fused_group", None)
        return None if fused is None else fused(key)  # type: ignore[no-any-return]


class _Through(WholeBuild):
    """A tensor the hooks build from state-dict tensors, each read from the Hub's through the outer layout."""

    def __init__(self, conv: _Built, by_state: Mapping[str, str], built: Mapping[str, Any]) -> None:
        super().__init__([k for n in conv.keys() for k in ([by_state[n]] if n in by_state else built[n].keys())],
                         conv.shape)
        self.conv, self.by_state, self.built = conv, by_state, built

    def full(self, read: Reader) -> torch.Tensor:
        def state(name: str) -> torch.Tensor:
            return read(self.by_state[name]) if name in self.by_state else self.built[name].full(read)  # type: ignore[no-any-return]
        return self.conv.full(state)
