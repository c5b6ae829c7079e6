"""The public contract every adapter fulfils."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ._results import Bucket, LoadResult, SleepReport, StateLoad

if TYPE_CHECKING:
    from .adapters.core.base import Adapter

__all__ = ["WrappedModel", "Handle", "LoadResult"]


class Handle:
    """Base of the package's own ``WrappedModel`` classes: the public model over a backend
    adapter, and views composed over one (the PEFT reference view). ``adapt()`` returns a
    ``Handle`` as it is.

    The read-only members below are the adapter's own: a view changes what runs, never
    the backend, group or device it runs on."""

    _below: Adapter  # the backend adapter this handle is composed over

    @property
    def backend(self) -> str:
        return self._below.backend

    @property
    def config(self) -> Any:
        return self._below.config

    @property
    def is_encoder_decoder(self) -> bool:
        return self._below.is_encoder_decoder

    @property
    def device(self) -> torch.device:
        return self._below.device

    @property
    def zero_stage(self) -> int | None:
        return self._below.zero_stage

    @property
    def is_sharded(self) -> bool:
        return self._below.is_sharded

    @property
    def world_size(self) -> int:
        return self._below.world_size

    @property
    def rank(self) -> int:
        return self._below.rank

    @property
    def data_parallel_size(self) -> int:
        return self._below.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self._below.data_parallel_rank

    def _as_adapter(self, purpose: str) -> Adapter:
        """The adapter to run ``purpose`` (e.g. "copy_to into it") on; a view that cannot
        serve it raises a ``WrapkitError`` saying why."""
        raise NotImplementedError


@runtime_checkable
class WrappedModel(Protocol):
    """One interface to a model, whatever wraps it.

    ``wm(...)`` is exactly ``wm.module(...)``: the adapter is never in the forward path.
    """

    @property
    def backend(self) -> str:
        """``"plain" | "dp" | "ddp" | "fsdp" | "fsdp2" | "deepspeed" | "tp"`` or a registered name."""
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

    @property
    def data_parallel_size(self) -> int:
        """How many different batches the ranks holding this model take at each step (1 if none)."""
        ...

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this rank takes; tensor-parallel ranks share one (0 if none)."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The innermost ``nn.Module``, optionally stopping at a PEFT or compile layer."""
        ...

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count: the same on every backend for the same model."""
        ...

    def resident_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (shards plus anything gathered); no collective."""
        ...

    def describe(self) -> str:
        """Human-readable multi-line summary."""
        ...

    # -- placement and freezing --------------------------------------------------------
    def place(self, device: torch.device | str | int | None = None) -> WrappedModel:
        """Move this rank's parameters/shards to ``device`` (``None``: the compute device), sharding kept;
        verified afterwards (``PlacementError`` names the offenders). Call on every rank. Returns ``self``."""
        ...

    def sleep(self, optimizer: Any = None, level: int = 1) -> SleepReport:
        """Parameters, gradients (level 2: dropped) and optimizer state of this rank to the CPU, sharding kept,
        for a colocated inference engine; the optimizer is the engine's under DeepSpeed. Collective."""
        ...

    def wake(self) -> WrappedModel:
        """Everything ``sleep()`` moved, back on the compute device, verified. Collective."""
        ...

    def to_eval_frozen(self) -> WrappedModel:
        """Eval mode, no parameter trainable, placed on ``device``; sharded stays sharded, DDP/DataParallel
        wrappers are dropped. Idempotent."""
        ...

    # -- full parameters -------------------------------------------------------------
    def gathered(self, modifier_rank: int | None = None) -> AbstractContextManager[torch.nn.Module]:
        """Context yielding ``unwrap()`` with full parameters on every rank; writes persist only from
        ``modifier_rank`` (on normal exit). Collective."""
        ...

    def generation(self, gather: str = "auto") -> AbstractContextManager[torch.nn.Module]:
        """Eval + no autograd + gradient checkpointing off, everything restored on exit; ``gather``:
        ``"full"`` (``gathered()``, unsharded speed), ``"layerwise"`` (per-unit, for models bigger than
        one device) or ``"auto"`` (full when it fits in memory)."""
        ...

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical_name, full tensor)`` pairs, gathered one parameter (or FSDP1 unit) at a time. Collective."""
        ...

    def stream_full_parameters(self, bucket_bytes: int = 512 * 2**20, dtype: torch.dtype | None = None,
                               merge_adapters: bool = False, *, keep_dtype: Callable[[str], bool] | None = None,
                               dst_rank: int | None = None, layout: str = "hub") -> Iterator[Bucket]:
        """Buckets ``(flat uint8 tensor, [(name, shape, dtype, offset)])`` of the full weights, each
        gathered in one collective, in the Hub's layout (``layout="runtime"``: the module's names and tensors);
        ``dtype`` converts (not where ``keep_dtype(name)``); ``merge_adapters`` folds LoRA layer by layer;
        ``dst_rank``: only that global rank gets buckets. Every rank iterates to the end."""
        ...

    # -- weights in and out ----------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers under canonical names, CPU tensors; ``{}`` off rank 0 if ``rank0_only``."""
        ...

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """The inverse of ``full_state_dict`` on any backend; every problem is reported before anything is written;
        returns the keys a ``strict=False`` load left out."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """One safetensors file, written atomically by rank 0."""
        ...

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                        merge_adapters: bool = False, *, adapters_only: bool = False,
                        adapter_names: Sequence[str] | None = None) -> None:
        """Sharded safetensors files + index in the Hugging Face layout, streamed, atomic per directory;
        ``adapters_only``: PEFT's adapter layout, every rank's rows in it."""
        ...

    def set_hub_layout(self, to_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
                       from_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None, *,
                       config: Any = None) -> WrappedModel:
        """Give the model its Hub layout as two functions on state dicts (torchtitan's ``to_hf`` / ``from_hf``);
        exports and loads in the Hub's layout use it, a layer at a time."""
        ...

    def load(self, path: str | os.PathLike[str], strict: bool = True, *, src_rank: int | None = None,
             adapter_name: str | None = None) -> LoadResult:
        """Load a safetensors file, a ``save_pretrained`` directory or a PEFT adapter directory, each rank
        reading only its slices; returns the keys a ``strict=False`` load left out."""
        ...

    def copy_to(self, target: WrappedModel, alpha: float = 1.0) -> None:
        """Name-aligned weight sync into another model; ``alpha < 1`` is EMA (``alpha*self + (1-alpha)*target``)."""
        ...

    # -- training state --------------------------------------------------------------
    def save_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *, scheduler: Any = None,
                   extra: Mapping[str, Any] | None = None) -> None:
        """Weights as the optimizer steps them, its state and param groups by canonical name, the scheduler,
        each rank's RNG and ``extra``, into ``directory`` (DCP format, atomic). Collective."""
        ...

    def load_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *,
                   scheduler: Any = None) -> StateLoad:
        """What ``save_state`` wrote, on any backend, topology and world size, checked whole first;
        returns ``StateLoad(extra, skipped)``. Collective."""
        ...
