"""Feeding ``stream_full_parameters`` buckets to an inference engine.

vLLM's models load weights through ``model.load_weights(iterable of (name, tensor))``, with the
Hugging Face names that ``stream_full_parameters`` gives (vLLM stacks q/k/v and gate/up itself).
``load_into`` hands each bucket over as such pairs, views into the bucket (nothing copied on
the way), one bucket at a time, so the engine holds one bucket beyond its own weights. The same
pairs load a plain ``torch.nn.Module`` (a transformers model) by name, which is how it is tested
where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._errors import StateDictError, UnsupportedModelError
from ..formats.hooks import HookLayout
from ..formats.hub import HubLayout
from ..sync.streaming import Bucket
from .engines._adapters import AdapterSync
from .engines._delta import DeltaReport, DeltaSync, SparsePatch
from .engines._engine_wire import EngineSync
from .engines._vllm_engine import VLLMEngine
from .engines._vllm_source import HubSource, ParamMeta, vllm_interface, weight_source

__all__ = ["load_into", "weight_source", "vllm_interface", "HubSource", "ParamMeta", "VLLMEngine", "EngineSync",
           "AdapterSync", "DeltaSync", "DeltaReport", "SparsePatch"]


def load_into(llm_or_model: Any, buckets: Iterable[Bucket]) -> list[str]:
    """Load every tensor of ``buckets`` into ``llm_or_model``; returns the names loaded, in order.

    ``llm_or_model``: a ``vllm.LLM`` (each bucket goes to its model through ``apply_model``, which
    runs in-process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and is sent to the workers otherwise),
    anything with vLLM's ``load_weights`` (a vLLM model), or a ``torch.nn.Module``, whose parameters
    and buffers are written by name. For a module every bucket's names and shapes are checked before
    it is written; from the first bucket that does not fit nothing more is written, the stream is
    still read to its end (its collectives stay matched with the other ranks'), and then
    ``StateDictError`` lists what did not fit.
    """
    feed, unfinished = _feeder(llm_or_model)
    loaded: list[str] = []
    problems: list[str] = []
    for bucket in buckets:
        pairs = list(bucket.named_tensors())
        if not problems:
            problems = feed(pairs)
        if not problems:
            loaded += [name for name, _ in pairs]
        del pairs, bucket  # freed as soon as the caller's stream moves on
    if not problems:
        problems = [f"{name}: some of the checkpoint tensors it is built from never came" for name in unfinished()]
    if problems:
        raise StateDictError(f"load_into() cannot load into {type(llm_or_model).__name__}: "
                             + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
                             + f". {len(loaded)} tensors before them were loaded. Stream from a model of the same "
                             "architecture (merge_adapters=True for a base model fed from a PEFT policy).")
    return loaded


Pairs = list[tuple[str, torch.Tensor]]


def _feeder(target: Any) -> tuple[Callable[[Pairs], list[str]], Callable[[], list[str]]]:
    """How ``target`` takes one bucket's pairs, each call returning what did not fit (nothing written
    then); and what it still waits for at the end."""
    if callable(getattr(target, "apply_model", None)):  # a vllm.LLM: its model lives in the engine
        def to_engine(pairs: Pairs) -> list[str]:
            target.apply_model(lambda model: model.load_weights(pairs))
            return []
        return to_engine, list
    if callable(getattr(target, "load_weights", None)):  # a vLLM model
        def to_model(pairs: Pairs) -> list[str]:
            target.load_weights(pairs)
            return []
        return to_model, list
    if isinstance(target, torch.nn.Module):
        own = dict(target.named_parameters(remove_duplicate=False)) | dict(target.named_buffers(remove_duplicate=False))
        # A transformers module takes the Hub's layout too: renamed, and per-expert tensors fused once
        # the last of a group is in; a module with state-dict hooks of its own takes its state dict's names.
        shapes = {n: tuple(t.shape) for n, t in own.items()}
        layout: Any = HubLayout.of(target) or HookLayout.of(target)
        importer = layout.importer(shapes) if layout is not None else None

        def by_name(pairs: Pairs) -> list[str]:
            if importer is not None:
                pairs = [made for name, t in pairs for made in
                         ([(name, t)] if name in own else importer.feed(name, t))]
            problems = _misfits(own, pairs)
            if not problems:
                with torch.no_grad():
                    for name, t in pairs:
                        own[name].copy_(t)
            return problems
        return by_name, importer.unfinished if importer is not None else list
    raise UnsupportedModelError(f"load_into() feeds a vllm.LLM, a model with load_weights(), or a torch.nn.Module; "
                                f"got {type(target).__name__}. Pass the engine or the model to load.")


def _misfits(own: Mapping[str, torch.Tensor], pairs: Pairs) -> list[str]:
    problems = [f"{name}: not in the module" for name, _ in pairs if name not in own]
    problems += [f"{name}: shape {tuple(t.shape)}, the module's is {tuple(own[name].shape)}"
                 for name, t in pairs if name in own and own[name].shape != t.shape]
    return problems
