"""What every backend's ``wrap_like`` and ``fresh_copy`` share: the transformer blocks that become
units, an empty skeleton of the model's class to shard before it is filled, and the buffers that no
shard holds."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from .._errors import ReferenceModelError
from .._names import canonical_name, model_class_name

if TYPE_CHECKING:
    from ._base import Adapter

__all__ = ["block_classes", "skeleton", "copy_buffers"]


def block_classes(model: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """Transformer block classes from ``_no_split_modules``; empty means "the root alone"."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def skeleton(adapter: Adapter) -> torch.nn.Module:
    """An uninitialised model of ``adapter``'s class, built from its config (weights come later)
    in its parameters' dtype; built under whatever device or ``zero.Init`` context is active."""
    inner = adapter.unwrap(keep_peft=False)
    cfg = getattr(inner, "config", None)
    if "peft" in adapter.stack or cfg is None:
        why = ("its PEFT model trains weights outside the adapters" if "peft" in adapter.stack
               else f"{model_class_name(inner)} has no config to rebuild it from")
        raise ReferenceModelError(
            f"cannot build a reference for this sharded {adapter.backend} policy without gathering it, because "
            f"{why}; pass ref_model (the model loaded again from its checkpoint)."
        )
    dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    model = type(inner)(copy.deepcopy(cfg))
    return model.to(dtype)


def copy_buffers(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Buffers are never sharded; non-persistent ones (rotary tables) are in no state dict."""
    theirs = {canonical_name(k): v for k, v in src.named_buffers()}
    with torch.no_grad():
        for name, buf in dst.named_buffers():
            other = theirs.get(canonical_name(name))
            if other is not None:
                buf.copy_(other)
