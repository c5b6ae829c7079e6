"""TRL's weight sync to vLLM, fed by wrapkit's stream.

TRL's ``VLLMGeneration.sync_weights()`` (GRPO, RLOO, the distillation trainer) walks the wrappers
itself (``_iter_named_params``): FSDP1 units summoned one by one from the module *inside*
accelerate's root wrapper (so the root's own parameters, embeddings, final norm and head, are never
sent), every parameter gathered at once and ``merge_adapter()`` run in place for PEFT (which raises
on FSDP1's sharded views, and moves frozen base weights by rounding), and the runtime names of
transformers 5 (fused 3-D experts, a vision-language model's ``model.language_model.*``).

``patch_trl()`` replaces that walk by ``vllm_weights``: the policy is found as accelerate prepared it,
read through its adapter's stream in the Hub's layout (experts per expert, each tied weight once,
LoRA folded layer by layer without touching the live weights, ``modules_to_save`` copies under the
base name), one bucket gathered at a time. TRL's ``sync_weights`` stays as it is around it: its
client and wire in server mode, ``load_weights`` of the in-process engine in colocate mode.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._adapt import adapt
from .._protocol import WrappedModel

__all__ = ["prepared_module", "prepared_policy", "vllm_weights", "iter_named_params"]

_MAX_DEPTH = 8  # wrappers around a model: DDP/engine/FSDP root, compile, ... never this many


def _holds(outer: Any, inner: torch.nn.Module) -> bool:
    """Whether ``inner`` is ``outer`` or sits in its chain of wrappers' ``.module`` (DDP, FSDP1, a DeepSpeed
    engine; a compiled wrapper hands its wrapped module's attributes through)."""
    node = outer
    for _ in range(_MAX_DEPTH):
        if node is inner:
            return True
        node = getattr(node, "module", None)
        if not isinstance(node, torch.nn.Module):
            return False
    return False


def prepared_module(model: torch.nn.Module, accelerator: Any = None) -> torch.nn.Module:
    """``model`` as the trainer trains it: the wrapper ``accelerator.prepare`` put around it (DDP, the
    FSDP1 root, a DeepSpeed engine; FSDP2 shards in place). Trainers hand their vLLM helpers the model
    from before ``prepare`` (TRL) or the one inside it (ms-swift), and FSDP1's root wrapper holds
    parameters the inner module does not reach. A model the accelerator does not list is itself: ``adapt()`` reads
    the inside of a DeepSpeed engine through the engine it finds, and refuses FSDP1's (whose wrapper cannot be found)
    naming what to pass, so the fallback is never a silent bare read."""
    for prepared in getattr(accelerator, "_models", None) or []:
        if _holds(prepared, model):
            # accelerate lists the module it put in DDP, not the DDP: found by what holds it, so that the
            # model reads as the replica of every rank it is (an engine sync refuses a lone rank's module).
            return _ddp_holding(prepared) or prepared  # type: ignore[no-any-return]
    return model


_DDP_OF: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def _ddp_holding(module: torch.nn.Module) -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` whose ``.module`` is ``module``, or None (remembered: a wrapper is
    built once). Found through the referrers of the module (the wrapper's ``_modules``), since the module keeps
    no link to its wrapper."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if module in _DDP_OF:
        return _DDP_OF[module]
    from torch.nn.parallel import DistributedDataParallel

    # module <- the wrapper's ``_modules`` <- its ``__dict__`` <- the wrapper: only dicts are followed.
    level: list[Any] = [module]
    for _ in range(3):
        found = [r for node in level for r in gc.get_referrers(node) if r is not level]
        for owner in found:
            if isinstance(owner, DistributedDataParallel) and owner.module is module:
                _DDP_OF[module] = owner
                return owner
        level = [r for r in found if isinstance(r, dict)]
    return None


def prepared_policy(model: torch.nn.Module, accelerator: Any = None) -> WrappedModel:
    """``prepared_module(model, accelerator)``, adapted."""
    return adapt(prepared_module(model, accelerator))


def vllm_weights(model: torch.nn.Module, accelerator: Any = None, *, to_rank: int | None = None,
                 bucket_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the policy in the Hub's layout, as vLLM's ``load_weights`` takes them, with
    LoRA merged. Collective: every rank iterates to the end. ``to_rank``: only that rank receives
    tensors (the others take part in the gathers and get nothing); ``None``: every rank does. Each
    tensor is a view into the current bucket, valid until the next one is taken."""
    wm = prepared_policy(model, accelerator)
    kwargs: dict[str, Any] = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    for bucket in wm.stream_full_parameters(merge_adapters="peft" in wm.stack, dst_rank=to_rank, **kwargs):
        yield from bucket.named_tensors()


def iter_named_params(self: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``VLLMGeneration._iter_named_params`` on wrapkit (installed by ``patch_trl()``): in server mode
    only the main process, which feeds TRL's client, receives tensors; in colocate mode every rank's
    engine does."""
    server = getattr(self, "mode", None) == "server"
    yield from vllm_weights(self.model, self.accelerator, to_rank=0 if server else None)
