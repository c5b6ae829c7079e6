"""The public API's ways in: ``adapt()`` and ``prepare_reference()``, and the handle they give (``Wrapped``, or the
``AdapterDisabledView`` of a PEFT policy's base model)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from ._agree import Call
from ._protocol import Handle, WrappedModel
from ._registry import as_adapter, copy_target
from ._results import LoadResult
from ._wrapped import Wrapped
from .adapters import Adapter
from .references import build as reference
from .references import view
from .sync import copy_to as sync
from .sync import sleeping
from .training import state as training_state

__all__ = ["AdapterDisabledView", "adapt", "prepare_reference", "public"]


class AdapterDisabledView(Wrapped):
    """A PEFT policy seen with its adapters off: the frozen base model, at no memory cost.

    Every read runs the operation ``Wrapped`` runs, over the policy's adapter decorated by
    ``view.AdaptersOff``: the adapters disabled, eval mode and no autograd where it runs the
    model, the policy's modes, adapters and ``requires_grad`` flags restored on exit, and the
    base model's names. What would write or move the policy's weights is refused with
    ``ReferenceModelError`` on every rank: ``load``, ``load_full_state_dict``, ``copy_to`` into it,
    ``gathered(modifier_rank=...)``, ``place`` elsewhere, ``sleep`` and ``wake``."""

    _below: view.AdaptersOff

    def __init__(self, adapter: view.AdaptersOff) -> None:
        super().__init__(adapter)
        self._view_module = view.ViewModule(adapter.policy)

    def _as_adapter(self, purpose: str) -> Adapter:
        raise view.refusal(purpose)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._below.policy!r}>"

    # Equality and hash are Wrapped's: the same view adapter (AdaptersOff over the same policy).

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._view_module(*args, **kwargs)

    @property
    def module(self) -> torch.nn.Module:
        """A module that runs the policy with its adapters off (it holds no parameters)."""
        return self._view_module

    def place(self, device: torch.device | str | int | None = None) -> AdapterDisabledView:
        """Verify that the policy's weights are on ``device`` (default: where the policy computes).
        A view cannot move them: ``ReferenceModelError`` if they are elsewhere."""
        view.verify_place(self._below, device, "place")
        return self

    def to_eval_frozen(self) -> AdapterDisabledView:
        """The view itself: every call through it already runs frozen, in eval mode."""
        view.verify_place(self._below, None, "to_eval_frozen")
        return self

    def sleep(self, optimizer: Any = None, level: int = 1) -> sleeping.SleepReport:
        """Refused: the view owns no weights; ``sleep()`` the policy."""
        view.refuse(self._below, Call.of("sleep", level=level), "sleep()")

    def wake(self) -> AdapterDisabledView:
        """Refused: the view owns no weights; ``wake()`` the policy."""
        view.refuse(self._below, Call.of("wake"), "wake()")

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """Refused: it would write the policy's weights."""
        view.refuse(self._below, Call.of("load_full_state_dict", strict=strict),
                    "load_full_state_dict() into it")

    def load(self, path: str | os.PathLike[str], strict: bool = True, *, src_rank: int | None = None,
             adapter_name: str | None = None) -> LoadResult:
        """Refused: it would write the policy's weights."""
        view.refuse(self._below, Call.of("load", strict=strict, src_rank=src_rank, adapter_name=adapter_name),
                    "load() into it")

    def load_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *,
                   scheduler: Any = None) -> training_state.StateLoad:
        """Refused: it would write the policy's weights."""
        view.refuse(self._below, Call.of("load_state", optimizer=type(optimizer).__name__ if optimizer is not None
                                         else None, scheduler=scheduler is not None), "load_state() into it")

    def copy_to(self, target: Any, alpha: float = 1.0) -> None:
        """``target = alpha*base + (1-alpha)*target``, into a model of the base architecture."""
        sync.copy_to(self._below, copy_target(target), alpha, itself=view.ITSELF)


def public(handle: Adapter | Handle) -> WrappedModel:
    """What the public API hands out for ``handle``: a view's adapter in the view, any other wrapped."""
    if isinstance(handle, view.AdaptersOff):
        return cast(WrappedModel, AdapterDisabledView(handle))
    return cast(WrappedModel, Wrapped(handle) if isinstance(handle, Adapter) else handle)


def adapt(model: Any) -> WrappedModel:
    """Return the ``WrappedModel`` for ``model``: any ``nn.Module``, any supported
    wrapper around one, or a ``WrappedModel`` (returned as is). Call on every rank.

    :param model: the model, in whatever holds it (a wrapper, a DeepSpeed engine, a ``PipelineStage``).
    :raises UnsupportedModelError: a model wrapkit cannot read whole (a layout, a library release or a
        stack it does not know), naming what and the way out.
    :raises MissingDependencyError: the wrapper's library is needed and not installed.
    """
    if isinstance(model, Handle):
        # Wrapped and views fulfil the protocol; mypy cannot see it through the common base.
        return cast(WrappedModel, model)
    return public(as_adapter(model))


def prepare_reference(policy: Any, ref_model: Any = None, *,
                      ds_config: dict[str, Any] | None = None) -> WrappedModel:
    """A frozen reference for ``policy``, sharded and placed as the policy is. Call on every rank.

    ZeRO-3 gives a DeepSpeed inference engine at stage 3 (the policy's config without
    optimizer, scheduler and optimizer offload; ``ds_config`` is merged over it); ZeRO-0/1/2
    an unsharded module in the engine's compute dtype; FSDP1/FSDP2 a model sharded at the
    policy's own units (per transformer block where a reference of another structure cannot
    match them) with the policy's group or mesh and mixed precision; DDP,
    DataParallel and plain the bare module. All on the policy's compute device.

    ``ref_model=None``: a PEFT policy whose only trainable parameters are its adapters gets an
    adapter-disabled view (no parameter memory); any other policy a fresh frozen copy of its
    current weights. A ``ref_model`` that is the policy or shares its parameters is refused
    with ``ReferenceModelError``.

    :param policy: the model in training (a ``WrappedModel``, or anything ``adapt()`` takes).
    :param ref_model: the reference's own model (the policy's loaded again), sharded here as the policy is;
        ``None``: a copy of the policy's current weights, or the adapter-disabled view.
    :param ds_config: merged over the DeepSpeed config the reference engine gets under ZeRO-3.
    :raises ReferenceModelError: a ``ref_model`` that shares the policy's parameters, or of another
        architecture; a policy whose reference cannot be built without it (named, with the way).
    :raises UnsupportedModelError: a backend whose frozen copy cannot be built (tensor parallelism applied
        by hand).
    :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
    """
    return public(reference.build_reference(policy, ref_model, ds_config=ds_config))
