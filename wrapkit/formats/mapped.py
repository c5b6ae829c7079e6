"""A model's Hub layout given as two functions on state dicts, applied one layer at a time.

A model that is not transformers' (torchtitan's, a trainer's own) has its Hub mapping as code of its own:
torchtitan's ``StateDictAdapter`` has ``to_hf(state_dict)`` and ``from_hf(hf_state_dict)``, which rename, permute
q/k rows for transformers' rotary layout, split stacked experts and drop a tied head. ``MappedLayout`` runs such
a pair on a stream: an export converts each layer's tensors together as soon as the layer is in (so a stream
never holds more than a layer), an import learns which checkpoint tensors make each of the model's by running
``from_hub`` on the meta device, with one source at a time marked by its dtype.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["MappedLayout", "WholeBuild", "give_layout", "given_layout", "row_segments"]

Entries = Mapping[str, tuple[tuple[int, ...], str]]
Reader = Callable[[str], torch.Tensor]
Convert = Callable[[dict[str, Any]], dict[str, Any]]

# A layer's tensors: names with a numbered ``layers``/``blocks``/``h`` component, in either layout.
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")
_MARK = torch.float64  # the dtype a marked source carries on the meta device


def _layer(name: str) -> str | None:
    found = _LAYER.search(name)
    return None if found is None else found.group(1)


class MappedLayout:
    """The conversions between a model's state-dict names and tensors and the Hub's, by ``to_hub`` and
    ``from_hub`` (each: a dict of tensors to a dict of tensors), one layer at a time. ``config``: the Hub config
    ``save_pretrained`` writes (anything with ``save_pretrained(directory)``), or None."""

    def __init__(self, to_hub: Convert, from_hub: Convert, config: Any = None) -> None:
        self.to_hub, self.from_hub, self.config = to_hub, from_hub, config
        self._dropped: frozenset[str] = frozenset()

    # -- state dict -> Hub ------------------------------------------------------------------------
    def export(self, entries: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Hub's ``(name, tensor)`` for a stream of state-dict ones: each run of one layer's tensors converted
        together when the next layer starts (or the stream ends), every other tensor on its own."""
        group: dict[str, torch.Tensor] = {}
        at: str | None = None
        for name, tensor in entries:
            layer = _layer(name)
            if group and (layer is None or layer != at):
                yield from self.to_hub(group).items()
                group = {}
            if layer is None:
                yield from self.to_hub({name: tensor}).items()
                continue
            at = layer
            group[name] = tensor.clone()  # a gather may reuse the storage before the layer is complete
        if group:
            yield from self.to_hub(group).items()

    # -- Hub -> state dict --------------------------------------------------------------------------
    def imports(self, entries: Entries, runtime: Iterable[str]) -> tuple[dict[str, str], dict[str, Any]]:
        """As ``HubLayout.imports``: each of the model's tensors (``runtime``: its state-dict names) as the
        build ``from_hub`` makes it from its sources; a checkpoint key that makes none stays under its own name in
        ``renamed``, for the caller to report."""
        from .safetensors import torch_dtype

        def meta(key: str, mark: bool = False) -> torch.Tensor:
            shape, dtype = entries[key]
            return torch.empty(shape, dtype=_MARK if mark else (torch_dtype(dtype) or torch.float32), device="meta")

        wanted = set(runtime)
        groups: dict[str | None, list[str]] = {}
        for key in entries:
            groups.setdefault(_layer(key), []).append(key)
        outside = groups.get(None, [])
        renamed: dict[str, str] = {}
        converted: dict[str, Any] = {}
        for layer, keys in groups.items():
            base = keys + ([] if layer is None else outside)  # what from_hub may need beside (a tied embedding)
            try:
                plain = self.from_hub({k: meta(k) for k in base})
            except Exception:  # a mapping that does not take these keys: they are reported as unexpected
                continue
            sources: dict[str, list[str]] = {}
            for key in keys:
                marked = self.from_hub({k: meta(k, k == key) for k in base})
                for name, value in marked.items():
                    if isinstance(value, torch.Tensor) and value.dtype == _MARK:
                        sources.setdefault(name, []).append(key)
            for name, value in plain.items():
                if name not in wanted or name not in sources or (layer is None) != (_layer(name) is None):
                    continue
                converted[name] = _Mapped(self, name, sources[name], base, entries, tuple(value.shape))
        used = {k for conv in converted.values() for k in conv.keys()}
        renamed.update({key: key for key in entries if key not in used})
        if isinstance(runtime, Mapping):  # what the mapping leaves out of the Hub's layout keeps its value
            self._dropped = frozenset(n for n in wanted if n not in converted and n not in entries
                                      and not self._kept(n, runtime[n]))
        return renamed, converted

    def _kept(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether ``to_hub`` puts the model's tensor ``name`` in the Hub's layout (run on the meta device)."""
        try:
            return bool(self.to_hub({name: torch.empty(shape, device="meta")}))
        except Exception:  # a mapping that needs a layer's other tensors with it
            return True

    def optional(self) -> frozenset[str]:
        """The model's tensors the mapping leaves out of the Hub's layout (torchtitan's load-balancing expert
        biases, a tied head), found by the last ``imports``: a Hub checkpoint lacks them, and they keep their
        values."""
        return self._dropped

    def hub_config(self) -> Any:
        return self.config


def row_segments(rows: Iterable[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Consecutive ``(source key, source row)`` pairs merged into ``(source key, first row, last row)`` ranges,
    in order: what a load reads of each source for a run of a built tensor's rows."""
    segments: list[tuple[str, int, int]] = []
    for key, at in rows:
        if segments and segments[-1][0] == key and segments[-1][2] == at:
            segments[-1] = (key, segments[-1][1], at + 1)
        else:
            segments.append((key, at, at + 1))
    return segments


class WholeBuild:
    """One tensor a layout makes from several checkpoint tensors (``keys()``), read whole: what a load needs of
    it beside ``HubLayout``'s ``Converted`` (its ``shape``, its rows)."""

    def __init__(self, keys: list[str], shape: tuple[int, ...] | None) -> None:
        self._keys, self.shape = keys, shape

    def keys(self) -> list[str]:
        return list(self._keys)

    def stacks_rows(self) -> bool:
        return False

    def rows(self, read: Reader, first: int, last: int) -> torch.Tensor:
        return self.full(read)[first:last]

    def full(self, read: Reader) -> torch.Tensor:
        raise NotImplementedError


class _Mapped(WholeBuild):
    """One state-dict tensor that ``from_hub`` makes from its ``sources``, read whole; the other keys its call
    sees (``base``) are on the meta device."""

    def __init__(self, layout: MappedLayout, name: str, sources: list[str], base: list[str], entries: Entries,
                 shape: tuple[int, ...]) -> None:
        super().__init__(sources, shape)
        self.layout, self.name = layout, name
        self._base = {k: entries[k] for k in base if k not in sources}

    def full(self, read: Reader) -> torch.Tensor:
        from .safetensors import torch_dtype

        given: dict[str, Any] = {k: torch.empty(s, dtype=torch_dtype(d) or torch.float32, device="meta")
                                 for k, (s, d) in self._base.items()}
        given.update({k: read(k) for k in self._keys})
        made: torch.Tensor = self.layout.from_hub(given)[self.name]
        return made


# The layouts given to models (``WrappedModel.set_hub_layout``), weak on the model: every wrapped view of it
# exports and loads through the one given.
_GIVEN: weakref.WeakKeyDictionary[torch.nn.Module, MappedLayout] = weakref.WeakKeyDictionary()


def give_layout(model: torch.nn.Module, layout: MappedLayout | None) -> None:
    """Make ``layout`` the Hub layout of ``model`` (None: forget the one given)."""
    if layout is None:
        _GIVEN.pop(model, None)
    else:
        _GIVEN[model] = layout


def given_layout(model: torch.nn.Module) -> MappedLayout | None:
    return _GIVEN.get(model)
