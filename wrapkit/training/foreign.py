"""Training checkpoints that other trainers wrote, read by ``load_state`` into any backend and world size.

Both are torch's distributed checkpoint (DCP) with every tensor under its module's name (as ``state_dict()``
gives it) and its full shape, so each rank reads only the boxes it holds, as for wrapkit's own; only the keys
differ:

- torchtitan's ``CheckpointManager`` (``<folder>/step-N``): the model's tensors at the top level, the optimizer
  flattened per name (``optimizer.state.<name>.exp_avg``, ``.step``; ``optimizer.param_groups.<name>.lr``);
- accelerate's ``save_state`` with FSDP2 (sharded state dict, DCP): ``pytorch_model_fsdp_0/`` with
  ``model.<name>``, and ``optimizer_0/`` with ``optimizer.state.<name>.<key>`` and the groups by index
  (``optimizer.param_groups.<i>.lr``, ``.params`` listing their names).

The weights, each parameter's optimizer state (per-element moments in boxes, the step whole) and the groups'
hyperparameters (matched by their parameters' names) are read; what such a checkpoint keeps in its own form (a
scheduler, RNG states, a data loader) is reported as skipped.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .._agree import Call, enter, raise_agreed
from .._results import StateLoad
from ..exchange.state_dict import expected_shapes
from ..formats.dcp import Blocks
from .held import Holding, put_scalar, state_tensors, unplaced

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["Foreign", "load_foreign"]

_FIX = ("Pass a torchtitan step-N directory or an accelerate FSDP2 save_state directory of this model (the same "
        "parameter names and shapes), with an optimizer of the same kind built over this model.")


class Foreign:
    """A directory of another trainer's checkpoint: where its model and optimizer tensors are, under which keys."""

    def __init__(self, kind: str, model_dir: str, optim_dir: str | None) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        self.kind, self.model_dir, self.optim_dir = kind, model_dir, optim_dir
        self.model_meta = FileSystemReader(model_dir).read_metadata()
        self.optim_meta = FileSystemReader(optim_dir).read_metadata() if optim_dir is not None else None
        self.prefix = "model." if kind == "accelerate" else ""

    @staticmethod
    def of(directory: str) -> Foreign | None:
        """The foreign checkpoint at ``directory``, or None where it is none wrapkit reads."""
        accelerate = os.path.join(directory, "pytorch_model_fsdp_0")
        if os.path.isfile(os.path.join(accelerate, ".metadata")):
            optim = os.path.join(directory, "optimizer_0")
            has_optim = os.path.isfile(os.path.join(optim, ".metadata"))
            return Foreign("accelerate", accelerate, optim if has_optim else None)
        if os.path.isfile(os.path.join(directory, ".metadata")):
            return Foreign("torchtitan", directory, directory)
        return None

    def tensors(self, meta: Any) -> dict[str, Any]:
        return {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}

    def state_keys(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, list[Any]]]:
        """Name -> {optimizer state key: its kind}: per element where it has the parameter's shape (the saved
        weight's, else the model's: a weight saved split by state-dict hooks), else whole."""
        if self.optim_meta is None:
            return {}
        out: dict[str, dict[str, list[Any]]] = {}
        weights = self.tensors(self.model_meta)
        for key, m in self.tensors(self.optim_meta).items():
            if not key.startswith("optimizer.state."):
                continue
            name, _, k = key.removeprefix("optimizer.state.").rpartition(".")
            dtype = str(m.properties.dtype)
            saved = weights.get(self.prefix + name)
            full = tuple(saved.size) if saved is not None else shapes.get(name)
            per_element = full is not None and tuple(m.size) == full and len(m.size) > 0
            out.setdefault(name, {})[k] = ["element", dtype] if per_element else ["tensor", dtype, list(m.size)]
        return out

    def hyper_keys(self, names: list[str]) -> list[str]:
        """The keys of the groups' hyperparameters that concern ``names`` (accelerate's: every group's)."""
        if self.optim_meta is None:
            return []
        keys = [k for k in self.optim_meta.state_dict_metadata if k.startswith("optimizer.param_groups.")]
        if self.kind == "accelerate":
            return keys
        wanted = {f"optimizer.param_groups.{n}." for n in names}
        return [k for k in keys if k.rpartition(".")[0] + "." in wanted]

    def hypers(self, loaded: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Name -> its group's hyperparameters, from the loaded hyperparameter keys."""
        by_name: dict[str, dict[str, Any]] = {}
        if self.kind == "accelerate":
            groups: dict[str, dict[str, Any]] = {}
            for key, value in loaded.items():
                index, _, hp = key.removeprefix("optimizer.param_groups.").partition(".")
                groups.setdefault(index, {})[hp] = value
            for group in groups.values():
                for n in group.get("params", []):
                    by_name[str(n)] = {k: v for k, v in group.items() if k != "params"}
            return by_name
        for key, value in loaded.items():
            name, _, hp = key.removeprefix("optimizer.param_groups.").rpartition(".")
            by_name.setdefault(name, {})[hp] = value
        return by_name


def _hooked(wm: Adapter, found: Foreign, weights: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The model's tensors (``shapes``: the model's, by name) its own load hooks build from tensors the checkpoint
    holds split (torchtitan's fused ``wqkv`` from ``wq``/``wk``/``wv``), by name."""
    from ..adapters.stages.plan import state_hooks

    hooks = state_hooks(wm)
    if hooks is None:
        return {}
    entries = {k.removeprefix(found.prefix): (tuple(m.size), "") for k, m in weights.items()
               if k.startswith(found.prefix)}
    return hooks.imports(entries, shapes)[1]


def load_foreign(wm: Adapter, directory: str, found: Foreign, optimizer: Any, scheduler: Any) -> StateLoad:
    """``load_state`` of another trainer's checkpoint (see the module docstring)."""
    from .reading import Object, dcp_group, read

    problems: list[str] = []
    source = Holding(wm, optimizer, "load_state", problems)
    optimizer = source.optimizer
    no_dist, group = dcp_group(wm, problems)
    shapes = expected_shapes(wm)
    keys = found.state_keys(shapes) if optimizer is not None else {}
    weights = found.tensors(found.model_meta)
    built = _hooked(wm, found, weights, shapes)
    if optimizer is not None and found.optim_meta is None:
        problems.append(f"the {found.kind} checkpoint has no optimizer state: pass optimizer=None")
    call = Call.of("load_state", optimizer=type(optimizer).__name__ if optimizer is not None else None,
                   scheduler=scheduler is not None)
    [agreed] = enter(call, wm, flags=[bool(problems)], invalid=1)
    raise_agreed(problems, f"load_state from {directory!r}", _FIX, wm, agreed=agreed)

    with torch.no_grad():
        if optimizer is not None:
            source.create(keys)
        held = source.held()
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        absent: list[str] = []
        split: list[tuple[Any, Blocks]] = []  # weights the model's hooks build from tensors saved split
        for key, blocks in state_tensors(held).items():
            if key.startswith("model/"):
                name = key.removeprefix("model/")
                saved = weights.get(found.prefix + name)
                conv = built.get(name)
                if saved is None and conv is not None and conv.shape == tuple(blocks.shape):
                    # Every rank reads the sources whole, and keeps its own boxes of what the hooks make of them.
                    for k in conv.keys():
                        model[found.prefix + k] = torch.empty(tuple(weights[found.prefix + k].size),
                                                              dtype=weights[found.prefix + k].properties.dtype)
                    split.append((conv, blocks))
                    continue
                if saved is None or tuple(saved.size) != tuple(blocks.shape):
                    absent.append(f"{name} {tuple(blocks.shape)}" + (
                        "" if saved is None else f" (saved as {tuple(saved.size)})"))
                model[found.prefix + name] = blocks
            else:
                name, _, k = key.removeprefix("optim/").rpartition("/")
                optim[f"optimizer.state.{name}.{k}"] = blocks
        steps: dict[str, tuple[Any, str, torch.Tensor]] = {}
        if optimizer is not None:
            absent += unplaced(held, keys)
        for h in held if optimizer is not None else []:
            for k, spec in keys.get(h.name, {}).items():
                if spec[0] == "tensor":
                    value = torch.zeros(tuple(spec[2]), dtype=getattr(torch, spec[1].rpartition(".")[2]))
                    steps[f"optimizer.state.{h.name}.{k}"] = (h, k, value)
                    optim[f"optimizer.state.{h.name}.{k}"] = value
        problem = [f"tensors missing from the {found.kind} checkpoint or saved with another shape "
                   f"({len(absent)}): {', '.join(absent[:5])}"] if absent else []
        if model and not any(k in weights for k in model):
            keys_there = ", ".join(sorted(weights)[:3]) or "none"
            problem = [f"{directory!r} is a torch distributed checkpoint (DCP) that another tool wrote, with none of "
                       f"this model's tensors (its keys: {keys_there}, ...). load_state reads save_state's "
                       "directories, torchtitan's step-N directories and accelerate's FSDP2 save_state directories; "
                       "read others with torch.distributed.checkpoint.load and their own keys"]
        raise_agreed(problem, f"load_state from {directory!r}", _FIX, wm)
        hyper = {k: Object() for k in found.hyper_keys(sorted({h.name for h in held}))} if optimizer else {}
        optim.update(hyper)
        parts: list[tuple[dict[str, Any], str, Any]] = [(model, found.model_dir, found.model_meta)]
        if optim:
            assert found.optim_dir is not None
            parts.append((optim, found.optim_dir, found.optim_meta))
        read(wm, directory, parts, no_dist, group, _FIX)
        for conv, blocks in split:
            blocks.fill_from(conv.full(lambda k: model[found.prefix + k]))
        for h, k, value in steps.values():
            put_scalar(optimizer, h, k, value)
        source.loaded()
    skipped = [f"RNG states, the data loader and the scheduler: a {found.kind} checkpoint keeps them in its own "
               "form; they are left as they were"]
    if optimizer is not None:
        by_name = found.hypers({k: v.value for k, v in hyper.items()})
        for i, (names, g) in enumerate(zip(source.group_names(), optimizer.param_groups, strict=True)):
            theirs = [n for n in names if n in by_name]
            if not theirs:
                skipped.append(f"param group {i}: none of its parameters has hyperparameters in the checkpoint; "
                               "they are left as they were")
                continue
            g.update({k: v for k, v in by_name[theirs[0]].items() if k in g and k != "params"})
            kinds = {repr(sorted(by_name[n].items())) for n in theirs}
            if len(kinds) > 1:
                skipped.append(f"param group {i} joins parameters of {len(kinds)} groups of the checkpoint; it takes "
                               f"the hyperparameters of {theirs[0]}'s")
    return StateLoad({}, skipped)
