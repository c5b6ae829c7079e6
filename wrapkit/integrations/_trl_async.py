"""TRL's async trainers (``AsyncGRPOTrainer``, ``AsyncDistillationTrainer``) syncing through wrapkit's stream.

Their ``_sync_weight_merged`` merges LoRA into the live weights in place (which raises on FSDP1's shards), walks
the wrappers itself (``_streaming_iter``: runtime names, ``full_tensor()`` per parameter), and a failed send
raises on the main process alone while the other ranks wait at the next barrier. Under ``patch_trl()``, where
the main process's ``weight_transfer`` takes a weight source (wrapkit's ``VLLMEngine``), the sync sends
``weight_source(policy)`` instead: the Hub's layout from any backend, LoRA merged bucket by bucket without touching
the live weights; every rank reads it to its end (the others drive the gathers), and the outcome is agreed, so a
failure raises ``EngineError`` on every rank. Other transfers (TRL's own NCCL client) keep TRL's walk: their
manifest is TRL's names.
"""

from __future__ import annotations

import time
from typing import Any

from .._errors import EngineError
from ._trl_sync import prepared_policy

__all__ = ["sync_weight_merged", "async_methods"]


def _ours(trainer: Any) -> bool:
    """Whether this sync goes through wrapkit's stream: the main process's transfer takes a weight source. Agreed,
    since only the main process holds the transfer."""
    from .engines._engine_wire import share

    transfer = trainer.weight_transfer if trainer.accelerator.is_main_process else None
    return bool(share(bool(getattr(transfer, "takes_weight_source", False)), 0))


def _source(trainer: Any) -> Any:
    """The policy's weight source, built once per trainer (its metadata pass is made on the first sync)."""
    from .engines._vllm_source import weight_source

    source = getattr(trainer, "wrapkit_source", None)
    if source is None:
        wm = prepared_policy(trainer.model, trainer.accelerator)
        source = weight_source(wm, merge_adapters="peft" in wm.stack)
        trainer.wrapkit_source = source
    return source


def sync_weight_merged(self: Any, t0: float) -> tuple[float, float, float]:
    """``_sync_weight_merged`` on wrapkit's stream (see the module); TRL's own where the transfer is not wrapkit's.
    Returns TRL's phase marks (pause, barrier, transfer)."""
    if not _ours(self):  # TRL's own, of the nearest class patched (a trainer may subclass TRL's)
        original = next(_ORIGINALS[c] for c in type(self).__mro__ if c in _ORIGINALS)
        return original(self, t0)  # type: ignore[no-any-return]
    from .engines._engine_wire import share, why

    accelerator = self.accelerator
    transfer = self.weight_transfer if accelerator.is_main_process else None
    error: str | None = None
    if transfer is not None:
        try:
            transfer.pause()
        except Exception as exc:
            error = f"pausing the server failed: {why(exc)}"
    t_pause = time.time()
    error = share(error, 0)  # a server that did not pause is sent nothing, on any rank
    if error is not None:
        raise EngineError(f"the weight sync of {type(self).__name__}: {error}")
    accelerator.wait_for_everyone()
    t_barrier = time.time()
    source = _source(self)
    try:
        if transfer is not None:
            transfer.send_weights(source)
        else:
            for _ in source:  # the gathers; ends with the agreed outcome of the pass
                pass
    except Exception as exc:
        error = why(exc)
    error = share(error, 0) or error
    if error is not None:
        raise EngineError(f"the weight sync of {type(self).__name__} failed (the server is left paused, its weights "
                          f"possibly partly this update's; the next sync resumes it): {error}")
    t_transfer = time.time()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if transfer is not None:
            transfer.resume()
        self.model_version += 1
        if self.rollout_worker:
            self.rollout_worker.update_model_version(self.model_version)
    return t_pause, t_barrier, t_transfer


_ORIGINALS: dict[type, Any] = {}


def async_methods() -> list[tuple[type, str, Any]]:
    """``(class, "_sync_weight_merged", drop-in)`` for each of TRL's async trainers this TRL has."""
    import importlib

    out: list[tuple[type, str, Any]] = []
    for module, name in (("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer"),
                         ("trl.experimental.async_distillation.async_distillation_trainer",
                          "AsyncDistillationTrainer")):
        try:
            owner = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # an older TRL, or one whose optional dependencies are missing
            continue
        original = owner.__dict__.get("_sync_weight_merged")
        if original is None:
            continue
        if original is not sync_weight_merged:
            _ORIGINALS[owner] = original
        out.append((owner, "_sync_weight_merged", sync_weight_merged))
    return out
