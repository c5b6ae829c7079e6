"""The operations ``wrapkit doctor`` runs on every backend, one column each.

An operation is ``fn(wm, ctx) -> None`` that raises on failure. It runs on every
rank of the doctor's group, so an operation that uses collectives is entered by
all ranks. Later features add their operation here, in protocol order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OPS", "Op"]

Op = Callable[[Any, dict[str, Any]], None]


def _config(wm: Any, ctx: dict[str, Any]) -> None:
    if ctx["has_config"]:
        cfg = wm.config
        assert not isinstance(cfg, dict), f"config is a {type(cfg).__name__}, the wrapper's, not the model's"
        assert cfg is wm.unwrap(keep_peft=False).config
    else:
        # A model with no config must say so with the typed error, not return something else.
        from .._errors import MissingConfigError

        try:
            _ = wm.config
        except MissingConfigError:
            return
        raise AssertionError("a model without config returned one")


def _unwrap(wm: Any, ctx: dict[str, Any]) -> None:
    inner = wm.unwrap()
    assert isinstance(inner, torch.nn.Module)
    assert type(inner).__name__ in wm.stack[-1] or wm.stack[-1] in type(inner).__name__


def _num_parameters(wm: Any, ctx: dict[str, Any]) -> None:
    n = wm.num_parameters()
    assert n == ctx["expected_parameters"], f"{n} parameters, expected {ctx['expected_parameters']}"


def _forward(wm: Any, ctx: dict[str, Any]) -> None:
    with torch.no_grad():
        out = wm(ctx["inputs"])
    logits = out.logits if hasattr(out, "logits") else out
    diff = float((logits.float().cpu() - ctx["expected_output"]).abs().max())
    assert diff < 1e-3, f"output differs from the unwrapped model by {diff:.2e}"


def _describe(wm: Any, ctx: dict[str, Any]) -> None:
    text = wm.describe()
    assert wm.backend in text and len(text.splitlines()) >= 5


OPS: list[tuple[str, Op]] = [
    ("config", _config),
    ("unwrap", _unwrap),
    ("num_parameters", _num_parameters),
    ("forward", _forward),
    ("describe", _describe),
]
