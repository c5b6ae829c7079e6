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
        """The innermost ``nn.Module``, optionally stopping at a PEFT or compile layer. No collective.

        :param keep_peft: stop at the PEFT model (``PeftModel``) where there is one, rather than its base model.
        :param keep_compile: stop at the ``torch.compile`` wrapper where there is one.
        :raises ArgumentError: a flag that is not ``True`` or ``False``.
        """
        ...

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count: the same on every backend for the same model.

        :param trainable_only: count only parameters with ``requires_grad`` (a collective on pipeline stages,
            where every stage counts its own).
        :raises ArgumentError: a flag that is not ``True`` or ``False``.
        """
        ...

    def resident_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (shards plus anything gathered); no collective."""
        ...

    def describe(self) -> str:
        """Human-readable multi-line summary."""
        ...

    # -- placement and freezing --------------------------------------------------------
    def place(self, device: torch.device | str | int | None = None) -> WrappedModel:
        """Move this rank's parameters/shards to ``device``, sharding kept, and verify it. Call on every rank.

        :param device: where to put them; ``None``: the compute device (``wm.device``).
        :returns: ``self``.
        :raises PlacementError: a tensor is elsewhere afterwards (named), or the backend cannot move there.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def sleep(self, optimizer: Any = None, level: int = 1) -> SleepReport:
        """This rank's parameters, gradients and optimizer state to the CPU, sharding kept, freeing the device
        for a colocated inference engine. Collective.

        :param optimizer: the torch optimizer whose state moves too (under DeepSpeed, the engine's own, found
            without it).
        :param level: 1 moves the gradients too, 2 drops them.
        :returns: a ``SleepReport`` of the bytes moved and freed.
        :raises ArgumentError: an unknown ``level``, or an optimizer over another model.
        :raises UnsupportedModelError: a backend whose states cannot move (a DeepSpeed release without
            ``offload_states``); nothing moved.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def wake(self) -> WrappedModel:
        """Everything ``sleep()`` moved, back on the compute device, verified. Collective.

        :returns: ``self``.
        :raises PlacementError: a tensor is not back on the compute device.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def to_eval_frozen(self) -> WrappedModel:
        """Eval mode, no parameter trainable, placed on ``device``; sharded stays sharded, DDP/DataParallel
        wrappers are dropped. Idempotent.

        :returns: the frozen model (a new ``WrappedModel`` where a wrapper was dropped).
        :raises PlacementError: a tensor could not be placed on the compute device.
        """
        ...

    # -- full parameters -------------------------------------------------------------
    def gathered(self, modifier_rank: int | None = None) -> AbstractContextManager[torch.nn.Module]:
        """Context yielding ``unwrap()`` with full parameters on every rank. Collective on entry and exit.

        :param modifier_rank: the rank whose writes to the full parameters persist (on normal exit, to every
            shard and optimizer copy); ``None``: writes are discarded.
        :raises ArgumentError: ``modifier_rank`` is not a rank of the model's group.
        :raises UnsupportedModelError: the whole model cannot be built here (pipeline stages without a config).
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def generation(self, gather: str = "auto") -> AbstractContextManager[torch.nn.Module]:
        """Eval + no autograd + gradient checkpointing off, everything restored on exit. Collective.

        :param gather: ``"full"`` (``gathered()``, unsharded speed), ``"layerwise"`` (per-unit, for models
            bigger than one device) or ``"auto"`` (full when it fits in memory).
        :raises ArgumentError: an unknown ``gather``.
        :raises UnsupportedModelError: ``"full"`` where the whole model cannot be built here.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical_name, full tensor)`` pairs in the module's own ``state_dict()`` names, gathered one
        parameter (or FSDP1 unit) at a time. Collective: every rank iterates to the end.

        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def stream_full_parameters(self, bucket_bytes: int = 512 * 2**20, dtype: torch.dtype | None = None,
                               merge_adapters: bool = False, *, keep_dtype: Callable[[str], bool] | None = None,
                               dst_rank: int | None = None, layout: str = "hub") -> Iterator[Bucket]:
        """Buckets of the full weights (``Bucket``: one flat uint8 tensor and its entries), each gathered in
        one collective. Every rank iterates to the end.

        :param bucket_bytes: the most bytes of one bucket (a larger tensor comes alone).
        :param dtype: convert floating tensors to it on the way (``None``: as they are).
        :param merge_adapters: fold PEFT's LoRA into the base weights, layer by layer, under the base names.
        :param keep_dtype: names for which ``dtype`` does not apply (routers, norms kept in fp32).
        :param dst_rank: only that global rank gets the buckets (the others iterate over empty ones).
        :param layout: ``"hub"`` (the Hub's names and tensors, as vLLM and SGLang load them) or ``"runtime"``
            (the module's own ``state_dict()`` names and tensors).
        :raises ArgumentError: a bad ``bucket_bytes``, ``dtype``, ``dst_rank`` or ``layout``.
        :raises UnsupportedModelError: LoRA layers that cannot be merged, with ``merge_adapters``.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    # -- weights in and out ----------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers under canonical names (the module's own ``state_dict()``), CPU
        tensors. Collective.

        :param rank0_only: only rank 0 gets the tensors; the others get ``{}``.
        :param merge_adapters: fold PEFT's LoRA into the base weights, under the base model's names.
        :raises UnsupportedModelError: LoRA layers that cannot be merged, with ``merge_adapters``.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """The inverse of ``full_state_dict`` on any backend. Collective: every rank passes the same ``sd``.

        :param sd: name -> full tensor, as ``full_state_dict`` gives.
        :param strict: refuse missing and unexpected keys (never a wrong shape).
        :returns: the keys a ``strict=False`` load left out (``LoadResult``).
        :raises StateDictError: every missing, unexpected or mis-shaped key, listed before anything is written.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """One safetensors file of the full state dict, written atomically by rank 0. Collective.

        :param path: the file to write (its directory must exist).
        :raises StateDictError: the file cannot be written; nothing is left half-written.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                        merge_adapters: bool = False, *, adapters_only: bool = False,
                        adapter_names: Sequence[str] | None = None) -> None:
        """Sharded safetensors files + index (and ``config.json``) in the Hugging Face layout, streamed,
        swapped in atomically. Collective.

        :param directory: the directory to write (its parent must exist).
        :param max_shard_size: the most bytes of one file (``"5GB"``, or an int).
        :param merge_adapters: fold PEFT's LoRA into the base weights, under the base names.
        :param adapters_only: write PEFT's adapter layout (``adapter_model.safetensors``) instead, every rank's
            rows in it.
        :param adapter_names: the adapters to write with ``adapters_only`` (default: the active ones).
        :raises ArgumentError: a bad ``max_shard_size`` or ``adapter_names``, or options that exclude each
            other.
        :raises StateDictError: the directory cannot be written; nothing is swapped in.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def set_hub_layout(self, to_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
                       from_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None, *,
                       config: Any = None) -> WrappedModel:
        """Give the model its Hub layout as two functions on state dicts (torchtitan's ``to_hf`` / ``from_hf``);
        exports and loads in the Hub's layout use it, a layer at a time. No collective.

        :param to_hub: the module's state dict (one layer's tensors, or one other tensor) -> the Hub's.
        :param from_hub: the inverse. ``None`` for both: back to the layout found.
        :param config: written as ``config.json`` by ``save_pretrained``.
        :returns: ``self``.
        :raises ArgumentError: one function given without the other, or one that is not callable.
        """
        ...

    def load(self, path: str | os.PathLike[str], strict: bool = True, *, src_rank: int | None = None,
             adapter_name: str | None = None) -> LoadResult:
        """Load a safetensors file, a ``save_pretrained`` directory (in the Hub's layout or the model's own)
        or a PEFT adapter directory, each rank reading only its slices. Collective.

        :param path: the file or directory.
        :param strict: refuse missing and unexpected keys (never a wrong shape).
        :param src_rank: only this rank reads the files and sends the values to the others (storage that the
            other ranks cannot see).
        :param adapter_name: with an adapter directory, the PEFT adapter to load into.
        :returns: the keys a ``strict=False`` load left out (``LoadResult``).
        :raises StateDictError: every missing, unexpected or mis-shaped key, a truncated or unreadable file,
            listed before anything is written.
        :raises ArgumentError: a bad ``src_rank`` or ``adapter_name``.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def copy_to(self, target: WrappedModel, alpha: float = 1.0) -> None:
        """Name-aligned weight sync into another model, on any pair of backends. Collective over both.

        :param target: the model to write (a reference, an EMA copy).
        :param alpha: ``1`` copies; ``alpha < 1`` is EMA (``alpha * self + (1 - alpha) * target``).
        :raises ArgumentError: ``alpha`` outside ``[0, 1]``.
        :raises StateDictError: the models' names or shapes differ (listed), nothing written.
        :raises ReferenceModelError: ``target`` is a view that cannot be written (a PEFT policy's base).
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    # -- training state --------------------------------------------------------------
    def save_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *, scheduler: Any = None,
                   extra: Mapping[str, Any] | None = None) -> None:
        """Weights as the optimizer steps them, its state and param groups by canonical name, the scheduler,
        each rank's RNG and ``extra``, into ``directory`` (torch's distributed checkpoint, swapped in
        atomically). Collective.

        :param directory: the directory to write (its parent must exist, on storage every rank shares).
        :param optimizer: the optimizer that steps the model (a DeepSpeed engine's is found without it; a
            container's inner optimizers are read: torchtitan's, accelerate's).
        :param scheduler: its state is saved too.
        :param extra: a picklable dict saved beside (the step, the data position).
        :raises ArgumentError: an optimizer or scheduler of the wrong kind, ``extra`` not a dict.
        :raises StateDictError: the directory cannot be written; nothing is swapped in.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...

    def load_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *,
                   scheduler: Any = None) -> StateLoad:
        """What ``save_state`` wrote (or a torchtitan or accelerate FSDP2 checkpoint), on any backend, topology
        and world size, checked whole first. Collective.

        :param directory: the checkpoint directory.
        :param optimizer: the optimizer to restore, built as when it was saved.
        :param scheduler: the scheduler to restore.
        :returns: ``StateLoad(extra, skipped)``: the ``extra`` saved, and what was not restored.
        :raises StateDictError: another model's checkpoint, another optimizer or param-group layout, other
            state keys, a truncated directory: every problem listed before anything changes.
        :raises DistributedStateError: the ranks called it with different arguments, or another rank failed.
        """
        ...
