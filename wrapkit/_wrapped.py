"""The public layer: the ``WrappedModel`` that ``adapt()`` and ``prepare_reference()`` hand out.

``Wrapped`` is composed over a backend adapter (detection, ``_registry``) and is the only
place where the protocol meets the operation modules: each of its methods is a one-line
call into one of them. The adapter below knows its backend's primitives and nothing of the
operations, so no layer imports one above it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from ._errors import ArgumentError
from ._protocol import Handle, WrappedModel
from ._registry import copy_target
from ._results import LoadResult
from .adapters import Adapter
from .base import args as _args
from .exchange import checkpoint, pretrained, reading, state_dict
from .exchange import peft as peft_checkpoint
from .formats.mapped import MappedLayout, give_layout
from .references import placement
from .sync import copy_to as sync
from .sync import gathering as full_parameters
from .sync import sleeping, streaming
from .training import state as training_state

__all__ = ["Wrapped"]


class Wrapped(Handle):
    """A model and the backend that wraps it, behind the ``WrappedModel`` protocol.

    ``wm(...)`` is ``wm.module(...)``; the backend's own objects are never replaced.
    """

    def __init__(self, adapter: Adapter) -> None:
        self._below = adapter

    def _as_adapter(self, purpose: str) -> Adapter:
        return self._below

    # -- identity ------------------------------------------------------------------
    def __repr__(self) -> str:
        a = self._below
        return f"<{type(a).__name__} backend={a.backend!r} stack={' > '.join(a.stack)}>"

    def __eq__(self, other: object) -> bool:
        # Same backend over the same object: a frozen DDP model's plain form equals adapt() of its module.
        return isinstance(other, Wrapped) and other._below == self._below

    def __hash__(self) -> int:
        return hash(self._below)

    # -- the forward path ----------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._below.module(*args, **kwargs)

    # -- read-only -------------------------------------------------------------------
    @property
    def backend_object(self) -> torch.nn.Module | None:
        """The native wrapper object (DDP, FSDP root, DeepSpeed engine, FSDP2 root module), or None."""
        return self._below.backend_object

    @property
    def stack(self) -> tuple[str, ...]:
        return self._below.stack

    @property
    def module(self) -> torch.nn.Module:
        return self._below.module

    def mesh(self) -> Any:
        """The device mesh the model is sharded over (FSDP2; FSDP1 where it was given one), else None."""
        return self._below.mesh()

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The innermost model, optionally stopping at a PEFT or compile layer.

        A compile layer *outside* a backend wrapper (``compile(DDP(model))``) is always
        peeled: keeping it would mean keeping the wrapper too.
        """
        return self._below.unwrap(_args.flag(keep_peft, "keep_peft", "unwrap"),
                                  _args.flag(keep_compile, "keep_compile", "unwrap"))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count, shared (tied) parameters counted once."""
        return self._below.num_parameters(_args.flag(trainable_only, "trainable_only", "num_parameters"))

    def resident_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds right now (its shards, plus anything
        currently gathered); no collective. Tied parameters count once."""
        return self._below.resident_parameter_bytes()

    def describe(self) -> str:
        """A human-readable multi-line summary."""
        return self._below.describe()

    # -- placement and freezing (references/placement.py) -------------------------------------------
    def place(self, device: torch.device | str | int | None = None) -> Wrapped:
        """Move this rank's parameters and shards to ``device`` (``None``: the compute device), keeping
        the sharding; then verify every one of them. Call it on every rank of the group together.

        Raises ``PlacementError`` naming the tensors that are elsewhere. Returns ``self``.
        """
        placement.place(self._below, device)
        return self

    def sleep(self, optimizer: Any = None, level: int = 1) -> sleeping.SleepReport:
        """Move this rank's training state off the compute device, for an inference engine that shares
        it: parameters (shards), gradients and optimizer state to the CPU, sharding kept. Level 2 drops
        the gradients instead. Under DeepSpeed the engine's optimizer is used (``offload_states``);
        otherwise pass the torch optimizer whose state should go too. Collective; ``wake()`` undoes it.
        Returns this rank's ``SleepReport`` (bytes of training state, bytes freed on the device)."""
        return sleeping.sleep(self._below, optimizer, level)

    def wake(self) -> Wrapped:
        """Everything ``sleep()`` moved, back on the compute device and verified. Collective. Returns ``self``."""
        sleeping.wake(self._below)
        return self

    def to_eval_frozen(self) -> Wrapped:
        """Eval mode on every submodule, ``requires_grad=False`` on every parameter, placed on
        ``self.device``. Sharded backends stay sharded; idempotent. Returns a ``WrappedModel``."""
        frozen = placement.to_eval_frozen(self._below)
        return self if frozen is self._below else Wrapped(frozen)

    # -- full parameters (sync/gathering.py) --------------------------------------------
    def gathered(self, modifier_rank: int | None = None) -> AbstractContextManager[torch.nn.Module]:
        """Yield ``unwrap()`` holding the full parameters on every rank. Collective.

        The module runs as a plain module inside (no FSDP/ZeRO-3 hooks in the call
        path), for reading, inference or in-place writes; not for backward. With
        ``modifier_rank=r``, in-place writes made on rank ``r`` reach every rank's
        weights (shards, replicas and optimizer master copies) on normal exit; without
        it, writes are discarded on sharded backends and must not be relied on
        anywhere. If the body raises on any rank, writes are discarded everywhere.
        Every submodule's ``training`` flag is restored on exit.
        """
        return full_parameters.gathered(self._below, modifier_rank)

    def generation(self, gather: str = "auto") -> AbstractContextManager[torch.nn.Module]:
        """Eval mode, no autograd and gradient checkpointing off, for ``generate()``. Collective.

        ``gather="full"``: ``gathered()`` inside; ``generate()`` runs at the unsharded model's
        speed on every backend, and entering costs one gather of the parameters.
        ``"layerwise"``: the backend's own per-unit gathering (ZeRO-3's hooks, FSDP units
        that unshard for their forward), for models that do not fit on one device whole;
        each rank holds its shards plus a unit or two, and every forward is collective.
        ``"auto"``: "full" when the gathered model fits this rank's free memory (less a
        margin; ``WRAPKIT_MEMORY_BUDGET`` overrides), "layerwise" otherwise, the same choice
        on every rank. Both give the same tokens. On exit, normal or by exception, every
        submodule's ``training`` flag and checkpointing setting are restored exactly.
        """
        return full_parameters.generation(self._below, gather)

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(canonical_name, full tensor)`` for every parameter, gathering one at a time. Collective.

        Names are the keys of ``unwrap().state_dict()`` without wrapper components,
        tied parameters under each of their names. Every rank must consume the
        iterator equally far. Tensors are detached, on the parameter's device; they
        share storage with the live weights where those are already full, and are
        fresh buffers otherwise: clone before writing into one.
        """
        return full_parameters.named_full_parameters(self._below)

    def stream_full_parameters(self, bucket_bytes: int = streaming.DEFAULT_BUCKET_BYTES,
                               dtype: torch.dtype | None = None, merge_adapters: bool = False, *,
                               keep_dtype: Callable[[str], bool] | None = None,
                               dst_rank: int | None = None, layout: str = "hub") -> Iterator[streaming.Bucket]:
        """The full parameters in buckets of about ``bucket_bytes``, each gathered in one collective:
        ``Bucket(flat, entries)``, a flat ``uint8`` tensor on the compute device and its
        ``(name, shape, dtype, offset)`` entries (``bucket.named_tensors()`` gives views).

        ``layout="hub"`` (the default) gives the checkpoint's names and tensors, as transformers'
        ``save_pretrained`` writes them and vLLM's and SGLang's ``load_weights`` take them: experts
        per expert, the Hub's prefixes, each tied weight once. ``layout="runtime"`` gives
        ``named_full_parameters()``'s names and tensors, for a module of the same class. Values are
        the weights the module holds (a bf16 engine's bf16 weights, not its fp32 masters).

        ``dtype`` converts floating tensors, except those whose name ``keep_dtype`` accepts.
        ``merge_adapters`` folds LoRA in one layer at a time, under the base model's names. With
        ``dst_rank`` (a global rank) only that rank gets buckets; the others still iterate to the
        end, which drives the collectives. Every rank must iterate equally far. Beyond its shards a
        rank holds about two buckets.
        """
        return streaming.stream_full_parameters(self._below, bucket_bytes, dtype, merge_adapters,
                                                keep_dtype=keep_dtype, dst_rank=dst_rank, layout=layout)

    # -- weights in and out (exchange/state_dict.py, exchange/checkpoint.py, sync/copy_to.py) ----------------
    def full_state_dict(self, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer under canonical names, as CPU tensors.

        Collective: every rank calls it; with ``rank0_only`` the other ranks get ``{}``.
        ``merge_adapters`` folds LoRA adapters into the base weights (base model's names)
        without changing the live model.
        """
        merge = _args.flag(merge_adapters, "merge_adapters", "full_state_dict")
        return state_dict.full_state_dict(self._below, _args.flag(rank0_only, "rank0_only", "full_state_dict"),
                                          merge_adapters=merge)

    def load_full_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """Load a full, canonically named state dict (the same on every rank); checks everything first.
        Returns ``LoadResult(missing_keys, unexpected_keys)``: what ``strict=False`` left out (logged
        as a warning too)."""
        return state_dict.load_full_state_dict(self._below, sd,
                                               _args.flag(strict, "strict", "load_full_state_dict"))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write one safetensors file atomically from rank 0 (temp file, fsync, rename). Collective."""
        checkpoint.save(self._below, _args.path(path, "path", "save"))

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                        merge_adapters: bool = False, *, adapters_only: bool = False,
                        adapter_names: Sequence[str] | None = None) -> None:
        """Write a Hugging Face layout checkpoint into ``directory``: ``model-0000k-of-0000n.safetensors``
        files of at most ``max_shard_size`` each, ``model.safetensors.index.json``, and the model's
        ``config.json`` / ``generation_config.json``. Collective.

        Streamed: parameters are gathered one (or one FSDP1 unit) at a time, and each rank of
        the group writes its share of the files in parallel, holding at most one file beyond
        its shards. Atomic per directory: everything is written to a temporary directory that
        replaces ``directory`` only when complete. ``merge_adapters`` folds LoRA in, layer by
        layer, under the base model's names (then ``from_pretrained`` of the base class loads it).

        ``adapters_only=True`` (a PEFT model) writes PEFT's own layout instead, for the adapters in
        ``adapter_names`` (default: every adapter): ``adapter_model.safetensors`` and
        ``adapter_config.json``, ``default`` at the top and any other in a subdirectory named after
        it, each matrix whole whatever the backend. ``peft.PeftModel.from_pretrained(base, directory)``
        loads it, and so does ``load(directory)``.
        """
        where = "save_pretrained"
        only = _args.flag(adapters_only, "adapters_only", where)
        merge = _args.flag(merge_adapters, "merge_adapters", where)
        path = _args.path(directory, "directory", where)
        if not only:
            if adapter_names is not None:
                raise ArgumentError("save_pretrained(adapter_names=...) selects adapters to save with "
                                    "adapters_only=True; pass adapters_only=True, or leave adapter_names out")
            pretrained.save_pretrained(self._below, path, max_shard_size, merge)
            return
        if merge:
            raise ArgumentError("save_pretrained(adapters_only=True, merge_adapters=True) asks for the adapters "
                                "alone and for them folded into the base weights; pass one of the two")
        names = _args.names(adapter_names, "adapter_names", where)
        peft_checkpoint.save_adapters(self._below, path, names)

    def set_hub_layout(self, to_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
                       from_hub: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None, *,
                       config: Any = None) -> Wrapped:
        """Give the model its Hub layout: ``to_hub(state_dict)`` returns the Hub checkpoint's tensors for some of
        the model's state dict (``unwrap().state_dict()``'s names and tensors), ``from_hub(hub_state_dict)`` the
        reverse (torchtitan's ``StateDictAdapter.to_hf`` / ``from_hf`` are such a pair); ``config`` (a
        transformers config) is written beside the weights. ``save_pretrained``, the default
        ``stream_full_parameters()``, the engine syncs and ``load`` of a Hub directory then use it, a layer at a
        time: each call gets one layer's tensors (names with ``layers.N.``) or one other tensor. torchtitan's
        models get their family's adapter without this. ``None, None`` goes back to the layout found. Every rank
        gives the same layout. Returns ``self``."""
        if (to_hub is None) != (from_hub is None) or any(f is not None and not callable(f) for f in (to_hub, from_hub)):
            raise ArgumentError("set_hub_layout(to_hub, from_hub) takes two functions from a dict of tensors to a "
                                "dict of tensors (or None, None to go back to the layout found); got "
                                f"{type(to_hub).__name__} and {type(from_hub).__name__}")
        give_layout(self._below.unwrap(keep_peft=False),
                    None if to_hub is None or from_hub is None else MappedLayout(to_hub, from_hub, config))
        return self

    def load(self, path: str | os.PathLike[str], strict: bool = True, *, src_rank: int | None = None,
             adapter_name: str | None = None) -> LoadResult:
        """Load a checkpoint: a safetensors file (``save``) or a directory (``save_pretrained``, or any
        Hugging Face layout with canonical names, or the Hub's layout of the model). Collective. Returns
        ``LoadResult(missing_keys, unexpected_keys)``: what ``strict=False`` left out, in the model's
        names and the checkpoint's (logged as a warning too; both empty after a strict load).

        Each rank reads only the byte ranges of the parameter elements it holds (its shards,
        or whole parameters where unsharded). With ``src_rank=r`` rank ``r`` alone reads and
        sends each tensor to the others, for nodes without shared storage. Every missing,
        unexpected or mis-shaped key, and every unreadable file, is reported on every rank
        before anything is written (``StateDictError``).

        A directory of PEFT adapters (``save_pretrained(adapters_only=True)`` or PEFT's own) loads
        into the adapters of the same names and nothing else; ``adapter_name`` loads one adapter's
        files (at the top of ``path``, or in its subdirectory) into the adapter of that name. A
        config that differs from the live adapter's (rank, target modules, alpha, ...) is refused."""
        return reading.load(self._below, _args.path(path, "path", "load"), _args.flag(strict, "strict", "load"),
                            src_rank, adapter_name)

    def copy_to(self, target: Any, alpha: float = 1.0) -> None:
        """``target = alpha*self + (1-alpha)*target``, by canonical name, any backend to any backend."""
        sync.copy_to(self._below, copy_target(target), alpha)

    def save_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *, scheduler: Any = None,
                   extra: Mapping[str, Any] | None = None) -> None:
        """Save what training resumes from into ``directory``, atomically: the weights as the optimizer steps
        them, its state for each parameter under the parameter's canonical name, its param groups, the
        ``scheduler``'s state, each rank's RNG states and ``extra`` (any picklable dict, rank 0's). Collective;
        each rank writes only the parts it holds, in torch's distributed checkpoint format, on storage every
        rank shares. ``load_state`` reads it on any backend, topology and world size."""
        training_state.save_state(self._below, _args.path(directory, "directory", "save_state"), optimizer,
                                  scheduler, extra)

    def load_state(self, directory: str | os.PathLike[str], optimizer: Any = None, *,
                   scheduler: Any = None) -> training_state.StateLoad:
        """Restore what ``save_state`` saved, on this model whatever its backend, topology or world size: the
        weights, ``optimizer``'s state (created where it has none yet) and param groups (matched by their
        parameters' names), the ``scheduler``'s state and this rank's RNG states. Collective; each rank reads
        only what overlaps its own parts. Every problem (another model's checkpoint, another optimizer class
        or param-group layout, other state keys, a truncated directory) is raised as ``StateDictError`` on
        every rank before anything changes. Returns ``StateLoad(extra, skipped)``. Also reads another
        trainer's DCP checkpoint (a torchtitan ``CheckpointManager`` step directory, an accelerate FSDP2
        ``save_state`` directory): weights, optimizer state and groups by name; the rest is named in ``skipped``."""
        return training_state.load_state(self._below, _args.path(directory, "directory", "load_state"),
                                         optimizer, scheduler)










def _conforms(wm: Wrapped) -> WrappedModel:
    """Checked by mypy: ``Wrapped`` implements the protocol."""
    return wm
