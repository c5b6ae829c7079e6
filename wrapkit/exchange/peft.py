"""PEFT adapter checkpoints: ``save_pretrained(adapters_only=True)`` and the adapter side of ``load``.

The directory is PEFT's own: ``adapter_model.safetensors`` under the keys PEFT saves (the adapter's
name taken out) and ``adapter_config.json``, for the adapter ``default`` at the top, for any other in
a subdirectory named after it. ``peft.PeftModel.from_pretrained(base, directory)`` loads it. Which
tensors go in and under which keys is read from the installed PEFT (``layers.peft.saved_key_map``).

Saving gathers only the units that hold adapter tensors, a bucket at a time, and rank 0 writes the
files into a temporary directory swapped in when complete (``_directory.open_directory``). Loading
maps the file's keys back to the live model's and hands ``reading.load`` a catalog of them: each rank
reads its slices of the adapters, and the base weights are not touched.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._agree import Call, writes_files
from .._errors import Listed, UnsupportedModelError
from ..adapters.stages.plan import every_stage, is_stage, stage_adapter_keys
from ..formats import safetensors as _safetensors
from ..formats.directory import commit_directory, open_directory
from ..formats.safetensors import INDEX_NAME, SINGLE_NAME, outside
from ..layers.peft import (
    ADAPTER_CONFIG,
    ADAPTER_PICKLE,
    ADAPTER_WEIGHTS,
    config_problems,
    saved_key_map,
    write_adapter_config,
)
from ..sync.streaming import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["save_adapters", "adapter_tensors", "adapter_dirs", "adapter_files", "adapter_shapes", "AdapterCheckpoint",
           "DEFAULT_ADAPTER"]

DEFAULT_ADAPTER = "default"


def _subdir(name: str) -> str:
    """Where PEFT puts an adapter's files, relative to the checkpoint directory."""
    return "" if name == DEFAULT_ADAPTER else name


def _peft_root(wm: Adapter, what: str) -> Any:
    root = wm.merge_root()
    if root is None and "peft" in wm.stack:  # the adapter-disabled view of a PEFT policy
        raise UnsupportedModelError(
            f"{what} needs the adapters, and {' > '.join(wm.stack)} is a view with them off; call it on the policy."
        )
    if root is None:
        fix = ("wrap the base model with peft.get_peft_model (the adapters' LoraConfig) before adapt(), then load"
               if what.startswith("loading") else
               "save the whole model with save_pretrained(directory), or wrap the base model with "
               "peft.get_peft_model first")
        raise UnsupportedModelError(f"{what} needs a PEFT model, and {' > '.join(wm.stack)} has no PEFT layer; {fix}.")
    return root


# -- saving --------------------------------------------------------------------------------------
def save_adapters(wm: Adapter, directory: str | os.PathLike[str], adapter_names: Sequence[str] | None) -> None:
    """Every selected adapter (all of them with ``None``) in PEFT's layout; see the module docstring.
    Collective."""
    problems: list[str] = []
    maps: dict[str, dict[str, str]] = {}  # adapter -> {canonical key: saved key}
    root: Any = None
    names: list[str] = []
    try:
        root = _peft_root(wm, "save_pretrained(adapters_only=True)")
        known = list(root.peft_config)
        names = known if adapter_names is None else list(adapter_names)
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            problems.append(f"adapter_names={list(names)!r} names no adapter or one the model lacks "
                            f"({', '.join(map(repr, unknown)) or 'none given'}); the model's adapters: "
                            f"{', '.join(map(repr, known))}")
        else:
            maps = {name: saved_key_map(root, name) for name in names}
            empty = [n for n, m in maps.items() if not m]
            # A pipeline stage may hold none of an adapter's layers: the stages' maps are joined below.
            if empty and not is_stage(wm):
                problems.append(f"PEFT saves no tensor of adapter(s) {', '.join(map(repr, empty))}")
    except UnsupportedModelError as exc:  # raised alike on every rank, after the entry
        problems.append(Listed(exc))
    call = Call.of("save_pretrained", adapters_only=True, adapter_names=tuple(names))
    directory, tmp = open_directory(wm, directory, call, problems,
                                    "Pass a directory whose parent exists, and adapter names the model has.")
    error: BaseException | None = None
    every = every_stage(wm, maps)
    if every is not None:  # each stage's LoRA layers are its own: the adapters are all of theirs
        maps = {name: {k: v for stage in every for k, v in stage.get(name, {}).items()} for name in names}
        empty = [n for n, m in maps.items() if not m]
        if empty:  # the same on every rank (the joined maps): nothing gathered, the directory left as it was
            error = UnsupportedModelError(f"PEFT saves no tensor of adapter(s) {', '.join(map(repr, empty))} on any "
                                          "pipeline stage")
    rank0 = writes_files(wm)
    wanted = {key for m in maps.values() for key in m}
    values = _gather(wm, wanted, keep=rank0) if error is None else {}

    def finish(tmp: str) -> None:
        for name, keys in maps.items():
            out = os.path.join(tmp, _subdir(name))
            os.makedirs(out, exist_ok=True)
            _safetensors.write_file({saved: values[key] for key, saved in keys.items()},
                                    os.path.join(out, ADAPTER_WEIGHTS))
            write_adapter_config(root, name, out)

    commit_directory(wm, "save_pretrained", directory, tmp, error, finish)


def adapter_tensors(wm: Adapter, adapter_name: str, keep: bool = True) -> dict[str, torch.Tensor]:
    """One adapter's tensors as PEFT's ``get_peft_model_state_dict`` names them (what its files hold), full CPU
    copies on a rank that ``keep``s them, nothing on the others. Collective: only the units that hold one are
    gathered. ``UnsupportedModelError`` (alike on every rank, before any collective) for a model without the
    adapter."""
    root = _peft_root(wm, "adapter_tensors")
    if adapter_name not in root.peft_config:
        raise UnsupportedModelError(f"adapter {adapter_name!r} is not one of the model's: "
                                    f"{', '.join(map(repr, root.peft_config))}; pass one of those")
    keys = saved_key_map(root, adapter_name)
    values = _gather(wm, set(keys), keep)
    return {saved: values[key] for key, saved in keys.items()} if keep else {}


def _gather(wm: Adapter, wanted: set[str], keep: bool) -> dict[str, torch.Tensor]:
    """Full CPU copies of the ``wanted`` entries (on a rank that ``keep``s them), as a checkpoint holds
    them (``gather_exported``): only the backend's units that hold one are gathered, several at a time
    up to the streaming bucket size."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str, value: torch.Tensor) -> None:
        if keep and name in wanted and name not in out:
            out[name] = value.detach().to("cpu", copy=True).contiguous()

    with torch.no_grad():
        units = wm.gatherer.units()
        if units is None:  # a layout gather_many does not serve: every parameter, one at a time
            for name, full in wm.gatherer.each():
                take(name, full)
        else:
            names: dict[int, list[str]] = {}
            for n, p in wm.named_live(buffers=False):
                names.setdefault(id(p), []).append(n)
            shapes = wm.weights.full_shapes()
            bucket: list[torch.nn.Parameter] = []
            size = 0

            def flush() -> None:
                for p, full in wm.gatherer.exported(bucket):
                    for n in names.get(id(p), ()):
                        take(n, full)

            for unit in units:
                if not any(n in wanted for p in unit for n in names.get(id(p), ())):
                    continue
                cost = sum(math.prod(shapes.get(id(p), tuple(p.shape))) * p.element_size() for p in unit)
                if bucket and size + cost > DEFAULT_BUCKET_BYTES:
                    flush()
                    bucket, size = [], 0
                bucket += unit
                size += cost
            if bucket:
                flush()
        for name, b in wm.named_live(parameters=False):
            take(name, b)
    return out


# -- loading -------------------------------------------------------------------------------------
def _holds_adapter(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in (ADAPTER_WEIGHTS, ADAPTER_PICKLE, ADAPTER_CONFIG))


def adapter_dirs(path: str, adapter_name: str | None) -> dict[str, str] | None:
    """adapter -> the directory holding its files, as PEFT lays them out under ``path``; None where
    ``path`` is not an adapter checkpoint (and no ``adapter_name`` asks for one)."""
    if not os.path.isdir(path):
        return None if adapter_name is None else {}
    if adapter_name is not None:
        # One adapter's files, at the top (PEFT's from_pretrained(..., adapter_name=)) or in its subdirectory.
        for where in (path, os.path.join(path, _subdir(adapter_name))):
            if _holds_adapter(where):
                return {adapter_name: where}
        return {}
    found = {DEFAULT_ADAPTER: path} if _holds_adapter(path) else {}
    if not found and any(os.path.isfile(os.path.join(path, f)) for f in (INDEX_NAME, SINGLE_NAME)):
        return None  # a model checkpoint: its subdirectories (a trainer's checkpoints) are not its adapters
    for entry in sorted(os.listdir(path)):
        sub = os.path.join(path, entry)
        if entry != DEFAULT_ADAPTER and os.path.isdir(sub) and _holds_adapter(sub):
            found[entry] = sub
    return found or None


class AdapterCheckpoint:
    """What a load of an adapter checkpoint reads: each adapter's safetensors file with its keys'
    renaming (saved key -> canonical key), the adapters the directory holds, and the problems
    found before reading a tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files: dict[str, tuple[str, dict[str, str]]] = {}  # file -> (adapter, saved key -> canonical)
        self.adapters: list[str] = []
        self.problems: list[str] = []  # those that keep the files from being read
        self.mismatches: list[str] = []  # of the saved configs against the live adapters'

    def rename(self, file: str, key: str) -> str:
        """The canonical key a file's key loads into; where the model has none, the key itself tagged
        with its adapter, so that the key check reports it as unexpected."""
        adapter, keys = self.files[file]
        return keys.get(key) or f"{key} (adapter {adapter!r})"


def adapter_files(wm: Adapter, path: str, adapter_name: str | None) -> AdapterCheckpoint | None:
    """For a load of ``path``: None where it is not an adapter checkpoint. Otherwise what to read,
    with every problem: no PEFT model, an adapter the model lacks, a file missing, a config that
    differs from the live one."""
    dirs = adapter_dirs(path, adapter_name)
    if dirs is None:
        return None
    out = AdapterCheckpoint(path)
    out.adapters = list(dirs)
    where = f"the adapter checkpoint {path!r}"
    if not dirs:
        out.problems.append(f"no adapter files ({ADAPTER_WEIGHTS}, {ADAPTER_CONFIG}) at {path!r}; pass the "
                            "directory that save_pretrained(adapters_only=True) or PEFT's save_pretrained wrote")
        return out
    try:
        root = _peft_root(wm, f"loading {where}")
    except UnsupportedModelError as exc:
        out.problems.append(Listed(exc))
        return out
    known = list(root.peft_config)
    for name, directory in dirs.items():
        if name not in known:
            hint = "pass adapter_name= to load it into one of them" if name == DEFAULT_ADAPTER else "add it first"
            out.mismatches.append(f"{where} holds adapter {name!r}, which the model lacks (its adapters: "
                                f"{', '.join(map(repr, known))}); {hint}")
            continue
        weights, config = os.path.join(directory, ADAPTER_WEIGHTS), os.path.join(directory, ADAPTER_CONFIG)
        escaping = [(f, real) for f in (weights, config)
                    if (real := outside(path, os.path.relpath(f, path))) is not None]
        if escaping:
            out.problems += [f"{f!r} leads to {real!r}, outside the adapter directory {path!r}; a checkpoint is read "
                             "from its own directory only: copy the file into it" for f, real in escaping]
            continue
        if not os.path.isfile(weights):
            pickled = os.path.isfile(os.path.join(directory, ADAPTER_PICKLE))
            out.problems.append(f"{directory!r} lacks {ADAPTER_WEIGHTS}" + (
                f" (it holds {ADAPTER_PICKLE}, PEFT's pickle format: save it again with safe_serialization=True)"
                if pickled else "; the checkpoint is incomplete: save it again"))
            continue
        try:
            with open(config) as f:
                saved = json.load(f)
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            out.problems.append(f"{config!r} is missing or unreadable ({type(exc).__name__}: {exc}); save the "
                                "adapter again")
            continue
        out.mismatches += config_problems(root, name, saved, where)
        try:
            # A pipeline stage's adapters are every stage's: those of the others' layers as recorded at adapt().
            keys = stage_adapter_keys(wm, name) | saved_key_map(root, name)
        except UnsupportedModelError as exc:
            out.problems.append(Listed(exc))
            continue
        out.files[weights] = (name, {saved_key: key for key, saved_key in keys.items()})
    return out


def adapter_shapes(wm: Adapter, adapters: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Canonical key -> full shape of every tensor PEFT saves of ``adapters`` (those the model has)."""
    root: Any = wm.merge_root()
    if root is None:
        return {}
    shapes = wm.weights.param_shapes()
    shapes.update((name, tuple(b.shape)) for name, b in wm.named_live(parameters=False))
    out: dict[str, tuple[int, ...]] = {}
    for name in adapters:
        if name in root.peft_config:
            try:
                keys = stage_adapter_keys(wm, name) | saved_key_map(root, name)
                out.update((key, shapes[key]) for key in keys if key in shapes)
            except UnsupportedModelError:
                pass  # adapter_files reported it
    return out
