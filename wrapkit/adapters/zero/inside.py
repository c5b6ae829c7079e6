"""The module inside a DeepSpeed engine, handed over without the engine.

Trainers keep it (transformers' ``Trainer.model`` under DeepSpeed, the model TRL gives its vLLM helper) and users
write ``engine.module``. Read as a bare module it is silently wrong: at ZeRO-3 every parameter is an empty
placeholder, and at ZeRO 1-2 a load is undone by the optimizer's fp32 masters at the next step. The engine that
holds it is found from the module instead: DeepSpeed hangs its forward hooks on ``engine.module`` (closures over
the engine), and where those are absent, a module that carries DeepSpeed's marks (ZeRO-3's partition metadata,
ZeRO 1-2's links to fp32 fragments) is looked up among the live engines; so is every module under a DeepSpeed
release whose engines hang no hooks (0.16), where a ZeRO-0 module carries no mark. A ZeRO 1-2 module no engine
holds (a deep copy, say) carries the marks but holds its own whole weights: it is the bare module it looks like.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..._imports import lookup

__all__ = ["zero_mark", "hooked_engines", "live_engines", "engines_hook_modules"]


def _engine_class() -> type | None:
    return lookup("deepspeed.runtime.engine", "DeepSpeedEngine")


def zero_mark(model: torch.nn.Module) -> tuple[str, bool] | None:
    """What DeepSpeed left on ``model``'s parameters, in words, and whether they are ZeRO-3 placeholders (nothing
    readable without a gather); None where it left nothing."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            return f"{name!r} is a ZeRO-3 placeholder (ds_id, ds_numel={getattr(p, 'ds_numel', '?')})", True
        if hasattr(p, "_hp_mapping"):
            return f"{name!r} is linked to a ZeRO optimizer's fp32 fragment (_hp_mapping)", False
    return None


def hooked_engines(objs: Sequence[torch.nn.Module]) -> list[Any]:
    """The engines whose forward hooks sit on one of ``objs`` as their ``engine.module``: DeepSpeed registers
    its forward prologue and epilogue on the module as closures over the engine. No scan of the heap."""
    cls = _engine_class()
    if cls is None:
        return []
    found: dict[int, Any] = {}
    for obj in objs:
        for hook in (*obj._forward_pre_hooks.values(), *obj._forward_hooks.values()):
            for value in _closed_over(hook):
                if isinstance(value, cls) and getattr(value, "module", None) is obj:
                    found.setdefault(id(value), value)
    return list(found.values())


def engines_hook_modules() -> bool:
    """Whether this DeepSpeed's engines hang hooks on their module (0.19 does, 0.16 does not), so that
    ``hooked_engines`` finds every engine; True where DeepSpeed was never imported (no engine can exist)."""
    cls = _engine_class()
    return cls is None or hasattr(cls, "_create_module_forward_pre_hook")


def live_engines() -> list[Any]:
    """Every DeepSpeed engine alive in this process (a scan of the objects the collector tracks, about 0.2 s
    with transformers and DeepSpeed loaded): only for a module that carries DeepSpeed's marks."""
    cls = _engine_class()
    if cls is None:
        return []
    return [obj for obj in gc.get_objects() if isinstance(obj, cls)]


def _closed_over(fn: Any) -> Iterator[Any]:
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
