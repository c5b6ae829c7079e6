"""The manifest ``save_state`` writes beside torch's distributed checkpoint (versions, parameter shapes, optimizer keys,
scheduler), and every check of a load against it, made before anything is read."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.stages.plan import is_stage
from .held import Holding
from .optimizers import Several

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["FORMAT", "MANIFEST", "class_name", "compare_optimizer", "compare_others", "compare_parameters",
           "read_manifest", "reader_class", "saved_keys", "versions"]


MANIFEST = "wrapkit_state.json"
FORMAT = 1


def versions(wm: Adapter) -> dict[str, str]:
    """wrapkit's, torch's, and those of the libraries the model's layers come from (its wrapper's, its own)."""
    from ..base.version import __version__

    out = {"wrapkit": __version__, "torch": torch.__version__}
    for obj in (wm.module, wm.backend_object, wm.unwrap(keep_peft=True), wm.unwrap(keep_peft=False)):
        top = type(obj).__module__.split(".")[0]
        if obj is not None and top not in out and top in sys.modules:
            out[top] = str(getattr(sys.modules[top], "__version__", "?"))
    return out


def class_name(obj: Any) -> str:
    if isinstance(obj, Several):
        return f"{class_name(obj.outer)}[{', '.join(class_name(o) for o in obj.inner)}]"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# -- load ---------------------------------------------------------------------------------------------------
@functools.cache
def reader_class() -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class Reader(FileSystemReader):  # type: ignore[misc]
        """DCP's file reader, given the metadata already read (and checked) once; a record that holds one plain
        tensor is read straight into its destination (``formats/records.py``), the others as DCP reads them."""

        def __init__(self, path: str, metadata: Any) -> None:
            super().__init__(path)
            self._known = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._known

        def read_data(self, plan: Any, planner: Any) -> Any:
            return super().read_data(read_plain(self, plan, planner), planner)
    return Reader


def read_plain(reader: Any, plan: Any, planner: Any) -> Any:
    """Read the items of ``plan`` that are plain tensor records, file by file in the order they lie; the plan of
    the rest (objects, transformed or other records) for DCP's own reader."""
    import dataclasses

    from torch.distributed.checkpoint.planner import LoadItemType

    from ..formats.records import read_record

    per_file: dict[str, list[Any]] = {}
    rest: list[Any] = []
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            rest.append(item)
        else:
            per_file.setdefault(info.relative_path, []).append(item)
    for relative, items in per_file.items():
        items.sort(key=lambda i: reader.storage_data[i.storage_index].offset)
        with open(os.path.join(reader.path, relative), "rb") as f:
            for item in items:
                info = reader.storage_data[item.storage_index]
                target = planner.resolve_tensor(item).detach()
                if read_record(f, info.offset, info.length, tuple(item.storage_offsets), tuple(item.lengths), target):
                    planner.commit_tensor(item, target)
                else:
                    rest.append(item)
    return dataclasses.replace(plan, items=rest)


def read_manifest(directory: str, problems: list[str]) -> tuple[dict[str, Any] | None, Any]:
    """The manifest and DCP's metadata, each checked; None where unreadable (the problem is listed)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        problems.append(f"{directory!r} is not a directory")
        return None, None
    try:
        with open(path) as f:
            manifest: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as exc:
        if not os.path.exists(path) and os.path.isfile(os.path.join(directory, ".metadata")):
            # Complete, in another format: torch's distributed checkpoint as another tool writes it.
            problems.append(f"{directory!r} is a torch distributed checkpoint (DCP) that another tool wrote (it has "
                            f"DCP's .metadata but no {MANIFEST}): load_state reads the directories save_state "
                            "writes. Read it with what wrote it (torchtitan's CheckpointManager for its step-N "
                            "directories) or torch.distributed.checkpoint.load with its own keys")
            return None, None
        problems.append(f"{path!r} cannot be read ({type(exc).__name__}: {exc}); this is not a complete save_state "
                        "directory")
        return None, None
    if manifest.get("format") != FORMAT:
        problems.append(f"{path!r} is format {manifest.get('format')!r}; this release reads format {FORMAT}")
        return None, None
    for name, size in manifest.get("files", {}).items():
        try:
            have = os.path.getsize(os.path.join(directory, name))
        except OSError:
            problems.append(f"file {name!r} is missing (the directory is incomplete)")
            continue
        if have != size:
            problems.append(f"file {name!r} has {have} bytes where {size} were written (truncated or changed)")
    if problems:
        return manifest, None
    try:
        return manifest, FileSystemReader(directory).read_metadata()
    except Exception as exc:
        problems.append(f"the checkpoint's metadata cannot be read ({type(exc).__name__}: {exc})")
        return manifest, None


def compare_parameters(wm: Adapter, manifest: dict[str, Any], problems: list[str]) -> None:
    saved = {n: tuple(s) for n, s in manifest["parameters"].items()}
    have = {n: tuple(s) for n, s in wm.weights.param_shapes().items()}
    missing = [n for n in have if n not in saved]
    unexpected = [n for n in saved if n not in have]
    shaped = [f"{n}: {saved[n]} saved, {have[n]} here" for n in have if n in saved and saved[n] != have[n]]
    for what, items in (("parameters the checkpoint lacks", missing), ("parameters this model lacks", unexpected),
                        ("shapes differ", shaped)):
        if items:
            problems.append(f"{what} ({len(items)}): {', '.join(items[:5])}{', ...' if len(items) > 5 else ''}"
                            f" (saved from {manifest.get('stack', ['?'])[-1]}; another model's checkpoint?)")


def saved_keys(manifest: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """Name -> {optimizer state key: its kind} (``_specs``), as saved."""
    saved: dict[str, dict[str, list[Any]]] = (manifest.get("optimizer") or {}).get("state", {})
    return saved


def compare_optimizer(source: Holding, manifest: dict[str, Any], saved_keys: dict[str, dict[str, Any]],
                       problems: list[str]) -> None:
    saved, optimizer = manifest.get("optimizer"), source.optimizer
    if saved is None:
        if optimizer is not None:
            problems.append("the checkpoint holds no optimizer state; pass optimizer=None, or resume from a "
                            "save_state given the optimizer")
        return
    if optimizer is None:
        problems.append(f"the checkpoint holds the state of a {saved['class']}; pass the optimizer to restore it")
        return
    if saved["class"] != class_name(optimizer):
        problems.append(f"the checkpoint's optimizer is a {saved['class']}, this one a {class_name(optimizer)}")
        return
    groups = source.group_names()
    want = saved["param_groups"]
    if is_stage(source.wm):  # its optimizer steps its own layers: the saved groups' names it holds
        here = {n for n, _ in source.wm.named_live(buffers=False)}
        want = [kept for names in want if (kept := [n for n in names if n in here])]
        groups = [names for names in groups if names]
    if sorted(map(tuple, groups)) != sorted(map(tuple, want)):
        sizes = [len(g) for g in want], [len(g) for g in groups]
        problems.append(f"the param groups differ: {len(sizes[0])} group(s) of {sizes[0]} parameters saved, "
                        f"{len(sizes[1])} of {sizes[1]} here, or other parameters in them; build the optimizer's "
                        "groups as when it was saved")
    # State that exists already (an optimizer that has stepped, a DeepSpeed engine's) must have the saved keys.
    wrong: list[str] = []
    for h in source.held():
        have, want = {*h.state, *h.scalars}, set(saved_keys.get(h.name, {}))
        if have and want and have != want:
            wrong.append(f"{h.name}: {sorted(have)} here, {sorted(want)} saved")
    if wrong:
        problems.append(f"optimizer state keys differ ({len(wrong)}): {'; '.join(dict.fromkeys(wrong[:3]))}")


def compare_others(manifest: dict[str, Any], scheduler: Any, problems: list[str]) -> None:
    saved = manifest.get("scheduler")
    if saved is None and scheduler is not None:
        problems.append("the checkpoint holds no scheduler state; pass scheduler=None")
    elif saved is not None and scheduler is None:
        problems.append(f"the checkpoint holds a {saved}'s state; pass the scheduler to restore it")
    elif saved is not None and saved != class_name(scheduler):
        problems.append(f"the checkpoint's scheduler is a {saved}, this one a {class_name(scheduler)}")
