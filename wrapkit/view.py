"""The reference a PEFT policy already contains: the policy with its adapters off.

``prepare_reference(policy, None)`` on a PEFT policy whose only trainable weights are its
adapters returns an ``AdapterDisabledView``. It is composed over the policy's adapter and
owns no parameters: every operation is the policy's own, run with every adapter disabled
(``adapters_off``), and everything it reports is named as the base model names it (no
``base_layer``, no LoRA keys). What would write the policy's weights or move them
(``load``, ``copy_to`` into the view, ``place`` elsewhere) is refused with
``ReferenceModelError``: those belong to the policy, or to a reference of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from . import _args
from ._agree import Call, check_modifier_rank, enter
from ._errors import PlacementError, ReferenceModelError, WrapkitError
from ._gather import restore_modes, set_modes
from ._protocol import Handle
from ._registry import copy_target
from .adapters import Adapter
from .checkpoint import write_checkpoint
from .full_parameters import gathered, generation, named_full_parameters
from .layers.peft import adapters_off, base_key_map, merged_layers
from .placement import resolve_device
from .pretrained import write_pretrained
from .sleeping import SleepReport
from .state_dict import expected_shapes, gather_state_dict, live_buffers
from .streaming import DEFAULT_BUCKET_BYTES, Bucket, stream_full_parameters
from .sync import copy_stream_to, source_stream

__all__ = ["AdapterDisabledView", "view_possible"]

_OWN_REFERENCE = "prepare_reference(policy, ref_model) for a reference with weights of its own"


class AdapterDisabledView(Handle):
    """A PEFT policy seen with its adapters off: the frozen base model, at no memory cost.

    Forward, ``gathered()``, ``generation()``, ``named_full_parameters()``,
    ``full_state_dict()``, ``save()`` and ``copy_to()`` run the policy's own operation with
    every adapter disabled, set eval mode and no autograd where they run the model, and
    restore the policy's modes, adapters and ``requires_grad`` flags on exit. Names are
    the base model's."""

    name: ClassVar[str] = "adapters-off"

    def __init__(self, policy: Adapter) -> None:
        self._policy = policy
        self._below = policy
        self._view_module = _ViewModule(policy)

    def _as_adapter(self, purpose: str) -> Adapter:
        raise _refusal(purpose)

    # -- identity ------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._policy!r}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterDisabledView) and other._policy == self._policy

    def __hash__(self) -> int:
        return hash((type(self), self._policy))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._view_module(*args, **kwargs)

    # -- read-only protocol: the policy's, as a frozen base model -------------------
    @property
    def stack(self) -> tuple[str, ...]:
        return (self.name, *self._policy.stack)

    @property
    def module(self) -> torch.nn.Module:
        return self._view_module

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The policy's module (the adapters are off only inside this view's calls)."""
        return self._policy.unwrap(_args.flag(keep_peft, "keep_peft", "unwrap"),
                                   _args.flag(keep_compile, "keep_compile", "unwrap"))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """The base model's global count; nothing is trainable through a view."""
        if _args.flag(trainable_only, "trainable_only", "num_parameters"):
            return 0
        # The policy's count less its adapters' (which are never tied, so counted once each).
        rename = self._rename()
        adapters = sum(math.prod(shape) for name, shape in self._policy.param_shapes().items()
                       if rename(name) is None)
        return self._policy.num_parameters() - adapters

    def resident_parameter_bytes(self) -> int:
        """0: the weights belong to the policy and are counted there."""
        return 0

    def describe(self) -> str:
        p = self._policy
        peft: Any = p.unwrap(keep_peft=True)
        lines = [
            "view:         the policy with its adapters off; owns no parameters",
            f"backend:      {p.backend}" + (f" (ZeRO stage {p.zero_stage})" if p.zero_stage is not None else ""),
            f"stack:        {' > '.join(self.stack)}",
            f"device:       {self.device}",
            f"group:        rank {self.rank} of {self.world_size}",
            f"sharded:      {'yes' if self.is_sharded else 'no'}",
            f"parameters:   {self.num_parameters():,} (0 trainable), the base model's",
            f"adapters:     {', '.join(map(str, getattr(peft, 'peft_config', {}))) or '-'} (off in every call)",
            "mode:         eval and no autograd in every call; the policy's modes are left as they are",
            f"config:       {type(getattr(p.unwrap(keep_peft=False), 'config', None)).__name__}",
        ]
        return "\n".join(lines)

    # -- placement: the policy's ------------------------------------------------------
    def place(self, device: torch.device | str | int | None = None) -> AdapterDisabledView:
        """Verify that the policy's weights are on ``device`` (default: where the policy computes).
        A view cannot move them: ``ReferenceModelError`` if they are elsewhere."""
        return self._verify_place(device, "place")

    def sleep(self, optimizer: Any = None, level: int = 1) -> SleepReport:
        """Refused: the view owns no weights; ``sleep()`` the policy."""
        enter(Call.of("sleep", level=level), self._policy)
        raise _refusal("sleep()")

    def wake(self) -> AdapterDisabledView:
        """Refused: the view owns no weights; ``wake()`` the policy."""
        enter(Call.of("wake"), self._policy)
        raise _refusal("wake()")

    def _verify_place(self, device: torch.device | str | int | None, op: str) -> AdapterDisabledView:
        problem: str | None = None
        try:
            target = self._policy.device if device is None else resolve_device(device)
        except WrapkitError as exc:
            problem, target = str(exc), self._policy.device
        off = [] if problem else [name for name, t in self._policy.placement_tensors() if t.device != target]
        bad, elsewhere = enter(Call.of(op), self._policy,
                               flags=[problem is not None, bool(off)], invalid=1)
        if bad:
            raise PlacementError(problem or f"place({device!r}) names a device another rank cannot use; see its error")
        if elsewhere:
            raise ReferenceModelError(
                f"this reference is a view of the policy's weights, which are not all on {target} "
                f"({', '.join(off[:4]) or 'on another rank'}); a view cannot move them. Place the policy, or use "
                f"{_OWN_REFERENCE}."
            )
        return self

    def to_eval_frozen(self) -> AdapterDisabledView:
        """The view itself: every call through it already runs frozen, in eval mode."""
        return self._verify_place(None, "to_eval_frozen")

    # -- full parameters ----------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, modifier_rank: int | None = None) -> Iterator[torch.nn.Module]:
        """The policy's ``gathered()`` with the adapters off. Read-only: a ``modifier_rank``
        would write the policy's base weights and is refused (on every rank alike)."""
        p = self._policy
        _check_unmerged(p)
        check_modifier_rank("gathered", modifier_rank, p)  # agreed before refusing
        if modifier_rank is not None:
            raise ReferenceModelError(
                f"gathered(modifier_rank={modifier_rank}) on a view would write the policy's base weights; "
                f"gather the policy to change them, or use {_OWN_REFERENCE}."
            )
        with gathered(p) as inner, adapters_off(p.unwrap(keep_peft=True)):
            yield inner

    @contextlib.contextmanager
    def generation(self, gather: str = "auto") -> Iterator[torch.nn.Module]:
        """The policy's ``generation(gather)`` with the adapters off: the base model generates, and
        the policy's modes, checkpointing, adapters and ``requires_grad`` flags come back on exit."""
        p = self._policy
        _check_unmerged(p)
        with generation(p, gather) as inner, adapters_off(p.unwrap(keep_peft=True)):
            yield inner

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's parameters under its own names (the adapters' are gathered and skipped)."""
        rename = self._rename()
        for name, t in named_full_parameters(self._policy):
            new = rename(name)
            if new is not None:
                yield new, t

    def stream_full_parameters(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                               merge_adapters: bool = False, *, keep_dtype: Callable[[str], bool] | None = None,
                               dst_rank: int | None = None) -> Iterator[Bucket]:
        """The base model's parameters in buckets, under its own names (the adapters' are gathered and
        left out). ``merge_adapters`` changes nothing: the adapters are off."""
        _args.flag(merge_adapters, "merge_adapters", "stream_full_parameters")
        return stream_full_parameters(self._policy, bucket_bytes, dtype, False, keep_dtype=keep_dtype,
                                      dst_rank=dst_rank, rename=self._rename())

    # -- weights out (and refused in) ----------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
        """The base model's state dict. ``merge_adapters`` changes nothing: the adapters are off."""
        _args.flag(merge_adapters, "merge_adapters", "full_state_dict")
        _args.flag(rank0_only, "rank0_only", "full_state_dict")
        enter(Call.of("full_state_dict", rank0_only=rank0_only, merge_adapters=merge_adapters), self._policy)
        return self._base_state(rank0_only)

    def _base_state(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        rename = self._rename()
        out: dict[str, torch.Tensor] = {}
        for name, t in gather_state_dict(self._policy, rank0_only).items():
            new = rename(name)
            if new is not None:
                out[new] = t
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """The base model's weights in one safetensors file, written atomically by rank 0."""
        write_checkpoint(self._policy, _args.path(path, "path", "save"), lambda: self._base_state(rank0_only=True))

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                        merge_adapters: bool = False) -> None:
        """The base model's weights as a Hugging Face layout checkpoint (``from_pretrained`` of the
        base class loads it). ``merge_adapters`` changes nothing: the adapters are off."""
        rename = self._rename()

        def entries() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in itertools.chain(self._policy.gather_each(), live_buffers(self._policy.unwrap())):
                if (new := rename(name)) is not None:
                    yield new, t

        write_pretrained(self._policy, _args.path(directory, "directory", "save_pretrained"), max_shard_size, entries,
                         True, _args.flag(merge_adapters, "merge_adapters", "save_pretrained"))

    def copy_to(self, target: Any, alpha: float = 1.0) -> None:
        """``target = alpha*base + (1-alpha)*target``, into a model of the base architecture."""
        tgt = copy_target(target)
        rename = self._rename()
        shapes = {new: s for n, s in expected_shapes(self._policy).items() if (new := rename(n)) is not None}
        stream = ((new, t) for n, t in source_stream(self._policy) if (new := rename(n)) is not None)
        same = (f"the target is the policy this reference is a view of; use {_OWN_REFERENCE}"
                if tgt.module is self._policy.module else None)
        copy_stream_to(self._policy, " > ".join(self.stack), shapes, stream, tgt, alpha, same)

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        enter(Call.of("load_full_state_dict", strict=strict), self._policy)  # refused together
        raise _refusal("load_full_state_dict() into it")

    def load(self, path: str | os.PathLike[str], strict: bool = True, *, src_rank: int | None = None) -> None:
        enter(Call.of("load", strict=strict, src_rank=src_rank), self._policy)
        raise _refusal("load() into it")

    def _rename(self) -> Callable[[str], str | None]:
        # Built per call: cheap (one walk of the modules) and never stale if adapters change.
        _check_unmerged(self._policy)
        return base_key_map(self._policy.unwrap(keep_peft=True))


def _check_unmerged(policy: Adapter) -> None:
    """Refuse a policy whose adapters are merged into its weights (the same on every rank)."""
    merged = merged_layers(policy.unwrap(keep_peft=True))
    if merged:
        raise ReferenceModelError(
            f"the policy's adapters are merged into its weights ({', '.join(merged[:3])}"
            f"{' and more' if len(merged) > 3 else ''}), so its base weights are not the base model's; call "
            "unmerge_adapter() on the policy first, or use " + _OWN_REFERENCE + "."
        )


def _refusal(purpose: str) -> ReferenceModelError:
    return ReferenceModelError(
        f"this reference is the policy itself with its adapters switched off, so {purpose} would act on the "
        f"policy's weights; act on the policy, or use {_OWN_REFERENCE}."
    )


class _ViewModule(torch.nn.Module):
    """The callable behind ``AdapterDisabledView.module``. The policy is held, not registered,
    so that nothing walking this module's parameters can freeze or move the policy."""

    def __init__(self, policy: Adapter) -> None:
        super().__init__()
        object.__setattr__(self, "_policy", policy)
        self.training = False

    @property
    def config(self) -> Any:
        policy: Adapter = self.__dict__["_policy"]
        return policy.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy: Adapter = self.__dict__["_policy"]
        _check_unmerged(policy)
        modes = set_modes(policy.module, False)
        try:
            with adapters_off(policy.unwrap(keep_peft=True)), torch.no_grad():
                return policy.module(*args, **kwargs)
        finally:
            restore_modes(modes)


def view_possible(pol: Adapter) -> bool:
    """A PEFT policy whose trainable parameters are all adapter parameters: with the adapters
    off it computes exactly the frozen base model, however far training has gone."""
    if "peft" not in pol.stack:
        return False
    peft_model: Any = pol.unwrap(keep_peft=True)
    names = [str(n) for n in getattr(peft_model, "peft_config", {})]
    if not names or not hasattr(peft_model, "disable_adapter"):
        return False
    for name, p in peft_model.named_parameters():
        parts = name.split(".")
        if p.requires_grad and not any(n in parts for n in names):
            return False
    return True

