"""Torch's own operators inside wrapkit's contexts.

Once a ZeRO-3 engine (or ``deepspeed.zero.Init``) exists, DeepSpeed replaces
``torch.nn.functional.linear`` for the whole process with an autograd function that saves
memory in ZeRO-3's backward, and never puts it back. Every other model in the process then
pays for it: a small model's ``generate()`` on the CPU runs about 1.7x slower. On full
parameters, and without a ZeRO-3 backward to serve, torch's own linear is exact and faster,
so wrapkit's contexts (``gathered()``, ``generation()``) and the forward of references it
builds outside DeepSpeed run with it. The engine's own training forward is left as DeepSpeed
set it up.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["replaced_ops", "torch_ops", "keep_torch_ops"]

# torch.nn.functional.linear is this builtin itself until something replaces it.
_TORCH_LINEAR = torch._C._nn.linear
_lock = threading.Lock()
_depth = 0
_saved: Any = None


def replaced_ops() -> dict[str, str]:
    """The ``torch.nn.functional`` operators DeepSpeed has replaced in this process, each with
    what replaced it (empty when none is)."""
    current = torch.nn.functional.linear
    if current is _TORCH_LINEAR or not _from_deepspeed(current):
        return {}
    return {"torch.nn.functional.linear": f"{getattr(current, '__module__', '?')}.{getattr(current, '__name__', '?')}"}


def _from_deepspeed(fn: Any) -> bool:
    for obj in (fn, getattr(fn, "__wrapped__", None), getattr(fn, "func", None)):
        if str(getattr(obj, "__module__", "") or "").startswith("deepspeed."):
            return True
    return False


def _enter() -> None:
    global _depth, _saved
    with _lock:
        if _depth == 0:
            current = torch.nn.functional.linear
            if current is not _TORCH_LINEAR and _from_deepspeed(current):
                _saved = current
                torch.nn.functional.linear = _TORCH_LINEAR
        _depth += 1


def _exit() -> None:
    global _depth, _saved
    with _lock:
        _depth = max(_depth - 1, 0)
        if _depth == 0 and _saved is not None:
            # Put back only what was taken out: a replacement made meanwhile (an engine built
            # inside the context) is DeepSpeed's to keep.
            if torch.nn.functional.linear is _TORCH_LINEAR:
                torch.nn.functional.linear = _saved
            _saved = None


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """Torch's own ``F.linear`` for the duration, where DeepSpeed has replaced it; nests, and
    puts DeepSpeed's back on the way out, exception or not."""
    _enter()
    try:
        yield
    finally:
        _exit()


_HOOKED = "_wrapkit_torch_ops"


def keep_torch_ops(module: torch.nn.Module) -> None:
    """Make every forward of ``module`` run with torch's own operators (two hooks; idempotent)."""
    if module.__dict__.get(_HOOKED):
        return

    def pre(mod: torch.nn.Module, args: Any) -> None:
        _enter()

    def post(mod: torch.nn.Module, args: Any, output: Any) -> None:
        _exit()

    # always_call: the exit runs even when the forward raises, so the depth stays balanced.
    module.register_forward_pre_hook(pre, prepend=True)
    module.register_forward_hook(post, always_call=True)
    module.__dict__[_HOOKED] = True
