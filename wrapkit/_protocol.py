"""The public contract every adapter fulfils."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["WrappedModel"]


@runtime_checkable
class WrappedModel(Protocol):
    """One interface to a model, whatever wraps it.

    ``wm(...)`` is exactly ``wm.module(...)``: the adapter is never in the forward path.
    """

    @property
    def backend(self) -> str:
        """``"plain" | "dp" | "ddp" | "fsdp" | "fsdp2" | "deepspeed"`` or a registered name."""
        ...

    @property
    def stack(self) -> tuple[str, ...]:
        """Layers outermost first, ending with the innermost model's class name."""
        ...

    @property
    def module(self) -> torch.nn.Module:
        """The outermost native object: what forward, backward and step go through."""
        ...

    @property
    def config(self) -> Any:
        """The innermost model's config (never a wrapper's); ``MissingConfigError`` if it has none."""
        ...

    @property
    def is_encoder_decoder(self) -> bool:
        """Read once at ``adapt()``."""
        ...

    @property
    def device(self) -> torch.device:
        """The compute device: where inputs must go."""
        ...

    @property
    def zero_stage(self) -> int | None:
        """0-3 for DeepSpeed, ``None`` otherwise."""
        ...

    @property
    def is_sharded(self) -> bool:
        """True when this rank holds only part of the parameters."""
        ...

    @property
    def world_size(self) -> int:
        """Size of the group the model is sharded or replicated over (1 if none)."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank in that group (0 if none)."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The innermost ``nn.Module``, optionally stopping at a PEFT or compile layer."""
        ...

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count: the same on every backend for the same model."""
        ...

    def describe(self) -> str:
        """Human-readable multi-line summary."""
        ...
