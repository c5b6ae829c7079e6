"""What the doctor's operations share: the refusal an operation raises where a backend does not serve it, and
the checks they make (logits, placement, training flags, tensors equal to a fresh model's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._registry import as_adapter

__all__ = ["Op", "Refused"]


Op = Callable[[Any, dict[str, Any]], None]


class Refused(Exception):
    """Raised by an operation that the stack refuses as documented, with the typed error and nothing
    changed: reported as not applicable, with the reason, neither a pass nor a failure."""


def _logits(model: Any, ctx: dict[str, Any], inputs: torch.Tensor, own: bool = True) -> torch.Tensor:
    """``model``'s logits for ``inputs``. ``own``: through the backend's own forward, which for Megatron-Core
    takes positions and a mask (True: left out) and may hand out a view of a buffer it reuses; otherwise the
    model is transformers' (what ``gathered()`` holds)."""
    with torch.no_grad():
        if own and ctx["backend"] == "megatron":
            n = inputs.shape[1]
            positions = torch.arange(n, device=inputs.device).expand_as(inputs)
            masked = torch.ones(1, 1, n, n, dtype=torch.bool, device=inputs.device).triu(diagonal=1)
            return model(inputs, positions, masked).clone()  # type: ignore[no-any-return]
        out = model(inputs, **ctx["extra_inputs"])
    return out.logits if hasattr(out, "logits") else out  # type: ignore[no-any-return]

def _forward(wm: Any, ctx: dict[str, Any]) -> None:
    if ctx["no_forward"]:
        raise Refused(ctx["no_forward"])
    diff = float((_logits(wm, ctx, ctx["inputs"]).float().cpu() - ctx["expected_output"]).abs().max())
    assert diff < ctx["output_tol"], f"output differs from the unwrapped model by {diff:.2e}"


def _forward_checked(wm: Any, ctx: dict[str, Any]) -> None:
    """The forward as the last check of another operation, where the backend's forward runs here."""
    if not ctx["no_forward"]:
        _forward(wm, ctx)


# -- placement and reference models ---------------------------------------------------
def _on_device(wm: Any, what: str) -> None:
    off = sorted({str(t.device) for _, t in as_adapter(wm).placement.tensors()} - {str(wm.device)})
    assert not off, f"{what}: tensors on {off}, expected all on {wm.device}"


# -- full parameters ---------------------------------------------------------------------
def _modes(wm: Any) -> list[bool]:
    return [m.training for m in wm.module.modules()]


# -- weights in and out ----------------------------------------------------------------
def _fresh_model(ctx: dict[str, Any], seed: int) -> torch.nn.Module:
    """The doctor's base model (seed 0 is the one every backend wrapped), unwrapped."""
    from ._families import any_model

    return any_model(ctx["model"], seed).to(ctx["device"])


def _expected(ctx: dict[str, Any], seed: int, parameters: bool = False) -> dict[str, torch.Tensor]:
    """The base model's state dict (or its parameters, tied ones under each name) in the backend's runtime
    layout: transformers' own, or the one of a backend that keeps a layout of its own (Megatron-Core)."""
    from ..formats.hub import hub_tensors

    model = _fresh_model(ctx, seed)
    layout = ctx["layout"]
    if layout is not None:  # built from the Hub's tensors (transformers may fuse them at run time)
        return dict(layout.from_hub(hub_tensors(model), ctx["names"]))
    return dict(model.named_parameters(remove_duplicate=False)) if parameters else dict(model.state_dict())


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = 0.0) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ ({sorted(set(got) ^ set(want))[:3]} ...)"
    bad = [k for k in want if float((got[k].double() - want[k].detach().cpu().double()).abs().max()) > tol]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[0]}"


@contextlib.contextmanager
def _shared_tmpdir(wm: Any) -> Iterator[str]:
    """A fresh directory made by rank 0 and known to every rank (the doctor's ranks share a machine),
    removed once every rank is done with it."""
    import shutil
    import tempfile

    import torch.distributed as dist

    distributed = as_adapter(wm).distributed and dist.is_initialized()
    obj = [tempfile.mkdtemp(prefix="wrapkit-doctor-") if wm.rank == 0 else ""]
    if distributed:
        dist.broadcast_object_list(obj, src=0)
    try:
        yield str(obj[0])
    finally:
        if distributed:
            dist.barrier()
        if wm.rank == 0:
            shutil.rmtree(obj[0], ignore_errors=True)


def _other(wm: Any, ctx: dict[str, Any], seed: int) -> Any:
    """A model of the base model's architecture holding seed ``seed``'s weights, for ``copy_to``: the plain
    transformers model, or for a backend in a layout of its own a frozen copy of its model (same layout)."""
    from .._adapt import adapt, prepare_reference

    if ctx["layout"] is None:
        return adapt(_fresh_model(ctx, seed))
    other = prepare_reference(wm.module, None)
    other.load_full_state_dict(_expected(ctx, seed))
    return other
