"""What a checkpoint (one safetensors file, or a directory of shards with its index) holds, read once for a load: the
entries in the model's runtime names through its layout, their files, shapes and dtypes, and what does not fit."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from .._errors import StateDictError
from .._imports import require
from ..formats.hub import Converted, Layout
from ..formats.safetensors import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME, outside, torch_dtype
from .peft import AdapterCheckpoint

if TYPE_CHECKING:
    pass

__all__ = ["Catalog", "_itemsize", "_unconverted", "dtype_problems"]


class Catalog:
    """The tensors of a checkpoint: their names, shapes and dtypes from the files' headers, and
    reads of element ranges. Opening it checks every file; ``StateDictError`` if one is missing,
    truncated or corrupt."""

    def __init__(self, path: str, stack: ExitStack, adapters: AdapterCheckpoint | None = None,
                 layout: Layout | None = None, runtime: Mapping[str, tuple[int, ...]] | None = None) -> None:
        st = require("safetensors", feature="loading a safetensors checkpoint", extra="transformers")
        # An adapter checkpoint's keys are PEFT's saved ones: each file's are renamed to the model's.
        files = self._files(path) if adapters is None else dict.fromkeys(adapters.files)
        self.bytes_read = 0  # what the reads below took from the files
        self.where: dict[str, tuple[Any, str]] = {}  # name -> (open file, its key there)
        self.entries: dict[str, tuple[tuple[int, ...], str]] = {}
        for file, names in files.items():
            try:
                handle = stack.enter_context(st.safe_open(file, framework="pt", device="cpu"))
                keys = list(handle.keys())
                for key in keys:
                    piece = handle.get_slice(key)
                    name = key if adapters is None else adapters.rename(file, key)
                    self.entries[name] = (tuple(piece.get_shape()), piece.get_dtype())
                    self.where[name] = (handle, key)
            except Exception as exc:  # safetensors raises its own error type (and OSError for I/O)
                raise StateDictError(
                    f"{file!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); it is truncated "
                    "or corrupt. Save it again, or load an earlier checkpoint."
                ) from exc
            absent = [n for n in names if n not in self.where] if names is not None else []
            if absent:
                raise StateDictError(f"the index of {path!r} puts {absent[:3]} in {file!r}, which lacks them; "
                                     "the checkpoint is incomplete: save it again")
        self.converted: dict[str, Converted] = {}
        self._kept: tuple[str, torch.Tensor] | None = None  # the last converted tensor built whole
        self._raw_where = self.where
        # What keeps the Hub layout's tensors from building a runtime one: reported with the keys' problems.
        self.problems: list[str] = []
        if layout is not None:
            self._to_runtime(path, layout, runtime or {})

    def _to_runtime(self, path: str, layout: Layout, runtime: Mapping[str, tuple[int, ...]]) -> None:
        """Checkpoint names and tensors in the Hub's layout seen under the model's runtime names."""
        raw, where = self.entries, self._raw_where
        renamed, converted = layout.imports(raw, runtime)
        self.entries = {name: raw[key] for name, key in renamed.items()}
        self.where = {name: where[key] for name, key in renamed.items()}
        for name, conv in converted.items():
            if conv.shape is None:
                self.problems.append(_unconverted(path, name, conv, runtime.get(name)))
                continue
            self.entries[name] = (conv.shape, raw[conv.keys()[0]][1])
            self.converted[name] = conv

    @staticmethod
    def _files(path: str) -> dict[str, list[str] | None]:
        """file -> the names the index puts in it (None: no index)."""
        if os.path.isfile(path):
            return {path: None}
        if not os.path.isdir(path):
            raise StateDictError(f"no checkpoint file or directory at {path!r}; pass the path that save() or "
                                 "save_pretrained() wrote")
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise StateDictError(f"{index!r} is not a readable index ({type(exc).__name__}: {exc}); save the "
                                     "checkpoint again") from exc
            escaping = [(name, file, real) for name, file in weight_map.items()
                         if (real := outside(path, str(file))) is not None]
            if escaping:
                listed = "; ".join(f"{name!r} -> {file!r} (which leads to {real!r})"
                                   for name, file, real in escaping[:3])
                raise StateDictError(
                    f"the index of {path!r} maps {len(escaping)} tensor(s) to files outside the directory: "
                    f"{listed}{'; ...' if len(escaping) > 3 else ''}. A checkpoint is read from its own directory "
                    "only; copy those files into it and name them relative to it")
            files: dict[str, list[str] | None] = {}
            for name, file in weight_map.items():
                names = files.setdefault(os.path.join(path, file), [])
                assert names is not None
                names.append(name)
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise StateDictError(f"the checkpoint in {path!r} lacks {len(missing)} file(s) its index names "
                                     f"({os.path.basename(missing[0])}, ...); it is incomplete: save it again")
            return files
        single = os.path.join(path, SINGLE_NAME)
        if os.path.isfile(single):
            real = outside(path, SINGLE_NAME)
            if real is not None:
                raise StateDictError(f"{single!r} is a link to {real!r}, outside the directory; a checkpoint is read "
                                     "from its own directory only: copy the file into it")
            return {single: None}
        raise StateDictError(f"{path!r} holds neither {INDEX_NAME} nor {SINGLE_NAME}; pass a directory that "
                             "save_pretrained() wrote, or a safetensors file")

    def read(self, name: str, start: int, numel: int, columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor ``name``: only the rows that
        cover them are read. ``columns``: of those whole rows, only columns ``[first, last)`` (dim 1), flattened
        (``Piece.columns``); a tensor stored as it is loads only them."""
        shape, _ = self.entries[name]
        conv = self.converted.get(name)
        if columns is not None:
            row = math.prod(shape[1:])
            first, last = start // row, (start + numel) // row
            if conv is None:
                handle, key = self.where[name]
                block: torch.Tensor = handle.get_slice(key)[first:last, columns[0]:columns[1]]
                self.bytes_read += block.numel() * block.element_size()
            else:
                block = self.full(name)[first:last, columns[0]:columns[1]]
            return block.reshape(-1)
        if conv is None and len(shape) == 0:
            handle, key = self.where[name]
            scalar: torch.Tensor = handle.get_tensor(key)
            return scalar.reshape(-1)
        row = math.prod(shape[1:])
        first, last = start // row, (start + numel + row - 1) // row
        rows: torch.Tensor
        if conv is None:
            handle, key = self.where[name]
            rows = handle.get_slice(key)[first:last]
            self.bytes_read += rows.numel() * rows.element_size()
        elif conv.stacks_rows():  # only the experts of these rows are read
            rows = conv.rows(self._source, first, last)
        elif hasattr(conv, "row_segments"):  # a layout that says which rows of its sources make these rows
            rows = torch.cat([self._source_rows(key, a, b) for key, a, b in conv.row_segments(first, last)])
        else:
            rows = self.full(name)[first:last]
        return rows.reshape(-1)[start - first * row: start - first * row + numel]

    def _source(self, key: str) -> torch.Tensor:
        """A checkpoint tensor under its own key, whole."""
        handle, key = self._raw_where[key]
        out: torch.Tensor = handle.get_tensor(key)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _source_rows(self, key: str, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` of a checkpoint tensor under its own key."""
        handle, key = self._raw_where[key]
        out: torch.Tensor = handle.get_slice(key)[first:last]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def full(self, name: str) -> torch.Tensor:
        if name in self.converted:
            if self._kept is None or self._kept[0] != name:  # several pieces of one rank read it in turn
                self._kept = (name, self.converted[name].full(self._source))
            return self._kept[1]
        handle, key = self.where[name]
        out: torch.Tensor = handle.get_tensor(key)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def total_bytes(self) -> int:
        return sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in self.entries.values())


def _unconverted(path: str, name: str, conv: Converted, want: tuple[int, ...] | None) -> str:
    """Why the checkpoint's tensors do not build ``name``: the experts counted where they are stacked."""
    if conv.stacks_rows() and want:
        short = [f"{len(keys)} of the {want[0]} per-expert tensors {pattern!r}"
                 for pattern, keys in conv.sources.items() if len(keys) != want[0]]
        if short:
            return (f"{name!r}: the checkpoint {path!r} holds {'; '.join(short)} it is stacked from (the Hub's "
                    "layout keeps each expert apart); it is incomplete or of another number of experts")
    keys = conv.keys()
    return (f"{name!r}: the checkpoint {path!r} holds the {len(keys)} tensor(s) transformers builds it from "
            f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}), but their shapes do not convert into "
            "one: it is of another configuration of this architecture")


def _itemsize(name: str) -> int:
    dtype = torch_dtype(name)
    return dtype.itemsize if dtype is not None else 0


def dtype_problems(entries: dict[str, tuple[tuple[int, ...], str]], path: str) -> list[str]:
    """One line per checkpoint tensor whose dtype this torch cannot hold, so that the load
    refuses it before anything is written."""
    bad = {name: dtype for name, (_, dtype) in entries.items() if torch_dtype(dtype) is None}
    if not bad:
        return []
    first = ", ".join(f"{n!r} ({d})" for n, d in list(bad.items())[:3])
    return [f"the checkpoint {path!r} holds {len(bad)} tensor(s) in a dtype torch {torch.__version__} cannot "
            f"read: {first}{', ...' if len(bad) > 3 else ''} (readable: {', '.join(SAFETENSORS_DTYPES)}); "
            "convert them, or load with a torch that has that dtype"]
