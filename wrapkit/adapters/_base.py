"""The adapter base class: the plain-module behaviour that every backend shares.

A backend adapter overrides only what its wrapper does differently: how it is
detected and peeled, which device computes, which group it lives on, how the
parameter count is read off its shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .._errors import DistributedStateError, MissingConfigError

__all__ = ["Adapter", "Entry", "model_class_name"]

# One peeled layer: (layer or backend name, the object at that level).
Entry = tuple[str, torch.nn.Module]


def model_class_name(obj: object) -> str:
    """The model's own class name, seeing through the classes FSDP2 generates (``FSDPLlama...``)."""
    for cls in type(obj).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp"):
            return cls.__name__
    return type(obj).__name__


class Adapter:
    """Base of every backend adapter; an instance is a ``WrappedModel``.

    Subclasses set ``name`` and implement ``matches`` (and ``inner`` when the
    backend is an outer wrapper object). ``peels`` says whether detection moves
    inside the object (DDP, FSDP1, DeepSpeed) or the object is the model itself
    (FSDP2 changes the class of the module it shards).
    """

    name: ClassVar[str] = "plain"
    peels: ClassVar[bool] = True
    # Whether this adapter needs an initialised process group.
    distributed: ClassVar[bool] = False

    # -- detection -----------------------------------------------------------------
    @classmethod
    def matches(cls, obj: object) -> bool:
        """Whether ``obj`` is this backend's wrapper. Must not import optional libraries."""
        return False

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        """The module this backend's wrapper holds."""
        inner = getattr(obj, "module", None)
        assert isinstance(inner, torch.nn.Module)
        return inner

    # -- construction --------------------------------------------------------------
    def __init__(self, module: torch.nn.Module, entries: list[Entry], backend_obj: torch.nn.Module | None,
                 innermost: torch.nn.Module) -> None:
        self._module = module
        self._entries = tuple(entries)
        self._backend_obj = backend_obj
        self._innermost = innermost
        self._check_group()
        cfg = getattr(innermost, "config", None)
        # Read once: generation code branches on it every step.
        self._is_encoder_decoder = bool(getattr(cfg, "is_encoder_decoder", False)) if cfg is not None else bool(
            getattr(innermost, "is_encoder_decoder", False)
        )

    # -- identity ------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend!r} stack={' > '.join(self.stack)}>"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and isinstance(other, Adapter) and other._module is self._module

    def __hash__(self) -> int:
        return hash((type(self), id(self._module)))

    # -- the forward path ----------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    # -- read-only protocol ----------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.name

    @property
    def stack(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._entries) + (model_class_name(self._innermost),)

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> Any:
        cfg = getattr(self._innermost, "config", None)
        if cfg is None:
            raise MissingConfigError(
                f"{model_class_name(self._innermost)} (innermost of {' > '.join(self.stack)}) has no `config` "
                "attribute; only models that carry one (e.g. transformers models) have a config to return."
            )
        return cfg

    @property
    def is_encoder_decoder(self) -> bool:
        return self._is_encoder_decoder

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The innermost model, optionally stopping at a PEFT or compile layer.

        A compile layer *outside* a backend wrapper (``compile(DDP(model))``) is always
        peeled: keeping it would mean keeping the wrapper too.
        """
        below_backend = self._backend_obj is None or not self.peels
        for name, obj in self._entries:
            if name == self.name and self._backend_obj is obj:
                below_backend = True
                continue
            if not below_backend:
                continue
            if (name == "peft" and keep_peft) or (name == "compile" and keep_compile):
                return obj
        return self._innermost

    @property
    def device(self) -> torch.device:
        for t in self._tensors():
            return t.device
        return torch.device("cpu")

    @property
    def zero_stage(self) -> int | None:
        return None

    @property
    def is_sharded(self) -> bool:
        return False

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count, shared (tied) parameters counted once."""
        return sum(
            self._global_numel(p) for p in self._unique_parameters() if p.requires_grad or not trainable_only
        )

    def describe(self) -> str:
        """A human-readable multi-line summary."""
        mods = list(self._innermost.modules())
        training = sum(1 for m in mods if m.training)
        total = self.num_parameters()
        trainable = self.num_parameters(trainable_only=True)
        lines = [
            f"backend:      {self.backend}"
            + (f" (ZeRO stage {self.zero_stage})" if self.zero_stage is not None else ""),
            f"stack:        {' > '.join(self.stack)}",
            f"device:       {self.device}",
            f"group:        rank {self.rank} of {self.world_size}",
            f"sharded:      {'yes' if self.is_sharded else 'no'}",
            f"parameters:   {total:,} ({trainable:,} trainable)",
            f"mode:         {training} of {len(mods)} modules in training mode",
            f"config:       {type(getattr(self._innermost, 'config', None)).__name__}",
        ]
        return "\n".join(lines)

    # -- helpers for subclasses ----------------------------------------------------
    def _process_group(self) -> Any:
        """The group the model is replicated/sharded over, for distributed backends."""
        return None

    def _check_group(self) -> None:
        if not self.distributed:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedStateError(
                f"{type(self._module).__name__} is a {self.name} wrapper but torch.distributed has no process "
                "group (never initialised, or destroyed); call adapt() between init_process_group() and "
                "destroy_process_group()."
            )
        group = self._process_group()
        try:
            # get_rank (unlike get_world_size) consults the registry of live groups.
            dist.get_rank(group)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise DistributedStateError(
                f"the process group of this {self.name} wrapper ({type(self._module).__name__}) is no longer "
                f"valid ({exc}); it was probably destroyed. Re-create the group and wrap the model again."
            ) from exc

    def _group_size_and_rank(self) -> tuple[int, int]:
        group = self._process_group()
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        return dist.get_world_size(group), dist.get_rank(group)

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self._innermost.parameters()
        yield from self._innermost.buffers()

    def _unique_parameters(self) -> Iterator[torch.nn.Parameter]:
        seen: set[int] = set()
        for p in self._innermost.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def _global_numel(self, p: torch.Tensor) -> int:
        """Elements of the full parameter ``p`` is (a shard of)."""
        return p.numel()
