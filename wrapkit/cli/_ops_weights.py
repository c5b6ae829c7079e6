"""The doctor's operations on weights: full state dicts, one-file and Hub-layout saves and loads, copy_to,
LoRA adapters and sleep/wake (``_ops.py`` lists them in protocol order)."""

from __future__ import annotations

from typing import Any

import torch

from .._registry import as_adapter
from ._op_support import (
    Refused,
    _assert_equal,
    _expected,
    _forward_checked,
    _fresh_model,
    _modes,
    _on_device,
    _other,
    _shared_tmpdir,
)

__all__ = ["_full_state_dict", "_save_load", "_save_pretrained", "_copy_to", "_adapters", "_sleep_wake"]


def _full_state_dict(wm: Any, ctx: dict[str, Any]) -> None:
    sd = wm.full_state_dict(rank0_only=False)
    want = _expected(ctx, 0)
    _assert_equal(sd, want, "full_state_dict vs the unwrapped model", ctx["weight_tol"])
    assert list(sd) == list(want), "full_state_dict keys are not in state_dict() order"
    assert all(t.device.type == "cpu" for t in sd.values()), "full_state_dict returned non-CPU tensors"


def _save_load(wm: Any, ctx: dict[str, Any]) -> None:
    import os

    from ..exchange.checkpoint import read_checkpoint

    original = wm.full_state_dict(rank0_only=False)
    with _shared_tmpdir(wm) as directory:
        path = os.path.join(directory, "model.safetensors")
        wm.save(path)
        _assert_equal(read_checkpoint(path), original, "the saved file")
        # Other weights in, then the file back: every weight must be restored exactly.
        wm.load_full_state_dict(_expected(ctx, 1))
        wm.load(path)
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after load")


def _save_pretrained(wm: Any, ctx: dict[str, Any]) -> None:
    """A sharded checkpoint in the Hugging Face layout, written by every rank, read back in slices."""
    import os

    original = wm.full_state_dict(rank0_only=False)
    with _shared_tmpdir(wm) as directory:
        path = os.path.join(directory, "ckpt")
        wm.save_pretrained(path, max_shard_size="16KB")
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        assert len(files) > 1 and "model.safetensors.index.json" in os.listdir(path), f"wrote {sorted(files)}"
        wm.load_full_state_dict(_expected(ctx, 1))
        wm.load(path)
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after load of the sharded checkpoint")


def _copy_to(wm: Any, ctx: dict[str, Any]) -> None:
    original = wm.full_state_dict(rank0_only=False)
    other = _other(wm, ctx, 1)
    before = other.full_state_dict(rank0_only=False)
    wm.copy_to(other, alpha=0.5)  # EMA into a plain model
    ema = {k: before[k] * 0.5 + original[k] * 0.5 for k in original}
    _assert_equal(other.full_state_dict(rank0_only=False), ema, "EMA copy_to", tol=1e-6 + ctx["weight_tol"])
    wm.copy_to(other)
    _assert_equal(other.full_state_dict(rank0_only=False), original, "exact copy_to")
    # And into this backend: other weights in, then the original ones back (rounded to its dtype).
    _other(wm, ctx, 1).copy_to(wm)
    _assert_equal(wm.full_state_dict(rank0_only=False), before, "copy_to into this backend", ctx["weight_tol"])
    _other(wm, ctx, 0).copy_to(wm)
    _assert_equal(wm.full_state_dict(rank0_only=False), original, "restoring by copy_to", ctx["weight_tol"])


# The query and value projections as each family names them.
_ATTENTION = ("q_proj", "v_proj", "q", "v", "q_b_proj", "kv_b_proj")


_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _lora(base: torch.nn.Module, seed: int, zeroed: bool) -> torch.nn.Module:
    """``base`` with LoRA on its query and value projections (and on its fused experts, PEFT's
    ``target_parameters``, where it has them), every matrix random (or zero)."""
    from peft import LoraConfig, get_peft_model

    from ._models import fill_adapters

    modules = {n.rpartition(".")[2] for n, _ in base.named_modules()}
    params = {n for n, _ in base.named_parameters()}
    experts = [t for t in _EXPERTS if any(n.endswith(t) for n in params)]
    # target_parameters only where there are experts: older PEFT releases (0.13 among them) have no such argument.
    extra: dict[str, Any] = {"target_parameters": experts} if experts else {}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[t for t in _ATTENTION if t in modules], **extra)
    return fill_adapters(get_peft_model(base, config), seed, zeroed)


def _adapters(wm: Any, ctx: dict[str, Any]) -> None:
    """This backend's PEFT stack: its adapters saved alone in PEFT's layout, loaded by PEFT onto a fresh
    base model, and resumed into zeroed adapters, every value exact."""
    import os

    import torch.distributed as dist

    from .._adapt import adapt
    from .._errors import UnsupportedModelError
    from .._imports import is_available
    from ._models import INDEPENDENT, build

    if not ctx["has_config"] or not is_available("peft"):
        raise Refused("needs transformers and peft")
    if ctx["layout"] is not None:
        raise Refused("PEFT's LoRA goes on transformers' layers, which a Megatron-Core model does not have (PEFT "
                      "layers inside one are refused at adapt())")

    def wrapped(seed: int, zeroed: bool) -> Any:
        def wrap(spec: str, model: torch.nn.Module) -> torch.nn.Module:
            return build(spec, model=model, device=ctx["device"], precision=ctx["precision"],
                         topology=ctx["topology"])

        if ctx["backend"] == "tp":  # the plan splits plain Linear layers: PEFT goes on after it
            return adapt(_lora(wrap("tp", _fresh_model(ctx, 0)), seed, zeroed))
        return adapt(wrap(ctx["backend"], _lora(_fresh_model(ctx, 0), seed, zeroed)))

    try:
        trained = wrapped(1, zeroed=False)
    except UnsupportedModelError as exc:  # PEFT on a tensor-parallel model
        raise Refused(str(exc).split(";")[0]) from exc
    want = {k: v for k, v in trained.full_state_dict(rank0_only=False).items() if "lora_" in k}
    with _shared_tmpdir(wm) as directory:
        # One directory per model: the layouts that train a model on each half of the ranks save two.
        model = dist.get_rank() // 2 if ctx["topology"] in INDEPENDENT and dist.is_initialized() else 0
        path = os.path.join(directory, f"adapters-{model}")
        trained.save_pretrained(path, adapters_only=True)
        if trained.rank == 0:
            from peft import PeftModel

            loaded = PeftModel.from_pretrained(_fresh_model(ctx, 0), path, autocast_adapter_dtype=False)
            got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
            _assert_equal(got, {k: v.to(got[k].dtype) if k in got else v for k, v in want.items()},
                          "PeftModel.from_pretrained of the saved adapters")
        resumed = wrapped(0, zeroed=True)
        resumed.load(path)
        got = {k: v for k, v in resumed.full_state_dict(rank0_only=False).items() if "lora_" in k}
        _assert_equal(got, want, "the adapters loaded back")


def _sleep_wake(wm: Any, ctx: dict[str, Any]) -> None:
    """The training state off the device and back: all of it on the CPU while asleep, the same values
    and modes after ``wake()``. (An engine brings its own optimizer; other backends sleep without one.)"""
    from .._errors import UnsupportedModelError
    from ..sync.sleeping import training_state

    original = wm.full_state_dict(rank0_only=False)
    modes = _modes(wm)
    try:
        report = wm.sleep()
    except UnsupportedModelError as exc:
        # Older DeepSpeed cannot move some engines' states: refused, with nothing moved.
        _on_device(wm, "a refused sleep()")
        _assert_equal(wm.full_state_dict(rank0_only=False), original, "after a refused sleep()")
        raise Refused(str(exc).split(";")[0]) from exc
    try:
        assert report.state_bytes > 0, f"sleep() reported no training state: {report}"
        off = sorted({what for what, t in training_state(as_adapter(wm), None) if t.device.type != "cpu"})
        assert not off, f"asleep, yet on the device: {off}"
    finally:
        wm.wake()
    _on_device(wm, "wake()")
    assert _modes(wm) == modes, "sleep/wake changed training flags"
    _assert_equal(wm.full_state_dict(rank0_only=False), original, "after sleep/wake")
    _forward_checked(wm, ctx)
