"""Checkpoints in the Hugging Face layout: ``save_pretrained`` writes sharded safetensors files
and their index, streamed and written by several ranks; ``load`` reads them back.

Saving walks the parameters in ``gather_each`` order (one parameter, or one FSDP1 unit, gathered
at a time). Every rank cuts the same stream into files of at most ``max_shard_size`` the same way,
so all agree, without talking, on which file each tensor goes to; file ``k`` belongs to writer
``k mod W`` (the ranks of the first replica that see the same directory), which keeps only the
tensors of the file it is filling and writes it in a thread while the next ones are gathered.
Everything goes to a temporary directory beside the target, swapped in when complete: a save
killed at any point leaves the previous checkpoint as it was, and the next save sweeps the
leftovers.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .._agree import (
    Call,
    any_over_models,
    first_replica,
    writes_files,
)
from .._errors import ArgumentError, Listed, WrapkitError
from ..adapters.stages.parts import stage_buffers
from ..adapters.stages.plan import layout_of
from ..base.memory import parse_size
from ..formats import safetensors as _safetensors
from ..formats.directory import commit_directory, open_directory
from ..formats.hub import Layout
from ..formats.safetensors import INDEX_NAME
from ..layers.lora_fold import lora_fold_stream
from .state_dict import joined_fold_plan, lora_fold_plan

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["save_pretrained", "INDEX_NAME"]

_log = logging.getLogger(__name__.rpartition(".")[0] or __name__)


def _file_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class _Writer:
    """The files one rank owns: filled one at a time, each written by a background thread
    while the next tensors are gathered. A write error is kept, not raised, so that the rank
    goes on taking part in the gathers; it is reported once all ranks are through."""

    def __init__(self, tmp: str, me: int, writers: int, live: set[int]) -> None:
        self.tmp, self.me, self.writers, self.live = tmp, me, writers, live
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.pending: concurrent.futures.Future[None] | None = None
        self.filling: dict[str, torch.Tensor] = {}
        self.written: list[int] = []
        self.error: BaseException | None = None
        self.held = self.peak = 0  # bytes of tensors copied and not yet written out

    def owns(self, k: int) -> bool:
        return k % self.writers == self.me

    def add(self, name: str, t: torch.Tensor) -> None:
        if not self.filling:
            self._wait()  # the previous file is on disk before this one grows: one file held at most
        if self.error is None:
            # A gathered tensor is this rank's own already; a live parameter or buffer (unsharded
            # backends) is copied, since training may change it before the file is written.
            own = t.numel() == 0 or t.untyped_storage().data_ptr() not in self.live
            self.filling[name] = t.detach().to("cpu").contiguous() if own else t.detach().to("cpu", copy=True)
            self.held += t.numel() * t.element_size()
            self.peak = max(self.peak, self.held)

    def _wait(self) -> None:
        if self.pending is not None:
            try:
                self.pending.result()
            except Exception as exc:
                self.error = self.error or exc
            self.pending = None
            self.held = sum(t.numel() * t.element_size() for t in self.filling.values())

    def close(self, k: int) -> None:
        tensors, self.filling = self.filling, {}
        if self.error is None:
            self.written.append(k)
            self.pending = self.pool.submit(_safetensors.write_file, tensors, self._part(k))

    def _part(self, k: int) -> str:
        return os.path.join(self.tmp, f"part-{k:05d}")

    def finish(self, n: int) -> None:
        """Wait for the last write, then give this rank's files their final names."""
        self._wait()
        self.pool.shutdown(wait=True)
        if self.error is None:
            try:
                for k in self.written:
                    os.replace(self._part(k), os.path.join(self.tmp, _file_name(k, n)))
            except OSError as exc:
                self.error = exc
        _log.debug("save_pretrained: rank %d wrote files %s of %d, holding at most %d bytes",
                   self.me, [k + 1 for k in self.written], n, self.peak)


def _config_files(wm: Adapter, tmp: str, base_keys: bool, layout: Layout | None) -> None:
    """config.json and generation_config.json, where the model has them and the keys are its own (``layout``:
    the model's Hub layout, as the files were written in it)."""
    if not base_keys:
        return  # a PEFT model's keys are not the base model's: its config would mislead from_pretrained
    # A model that is not transformers' (Megatron-Core's, torchtitan's, one given a layout): its layout says
    # which Hub model it is.
    made = getattr(layout, "hub_config", lambda: None)()
    if made is not None:
        made.save_pretrained(tmp)
        return
    inner = wm.unwrap(keep_peft=False)
    for obj in (getattr(inner, "config", None), getattr(inner, "generation_config", None)):
        if obj is not None and callable(getattr(obj, "save_pretrained", None)):
            obj.save_pretrained(tmp)


def save_pretrained(wm: Adapter, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                    merge_adapters: bool = False) -> None:
    """Write every parameter and persistent buffer as ``model-0000k-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` (and the model's ``config.json`` and ``generation_config.json``)
    into ``directory``, atomically, in the Hub's layout (``formats.hub``: the names, tensors and tied
    weights transformers' own ``save_pretrained`` writes). Collective; see the module docstring."""
    refused: WrapkitError | None = None
    try:
        plan = lora_fold_plan(wm) if merge_adapters else None
    except WrapkitError as exc:  # raised after the entry, on every rank alike, as itself (its own cause and fix)
        plan, refused = None, exc
    # The names are the base model's (and its config files go along) when merged, or without PEFT.
    base_keys = plan is not None or wm.merge_root() is None

    # In the Hub's layout (transformers' own save's names and tensors) where the keys are the base model's.
    layout = layout_of(wm) if base_keys else None

    def runtime() -> Iterator[tuple[str, torch.Tensor]]:
        # Parameters gathered one at a time, LoRA merged layer by layer with a plan; then buffers.
        yield from lora_fold_stream(plan, wm.gatherer.each())
        yield from lora_fold_stream(plan, stage_buffers(wm))

    def entries() -> Iterator[tuple[str, torch.Tensor]]:
        return runtime() if layout is None else layout.export(runtime())

    # Every rank cuts the stream into files the same way, so the size and the merge must match; the
    # directory need not (without shared storage, rank 0 writes everything).
    problems: list[str] = []
    limit, size_given = 1, max_shard_size
    try:
        limit = size_given = parse_size(max_shard_size, "max_shard_size")
    except ArgumentError as exc:
        problems.append(Listed(exc))
    call = Call.of("save_pretrained", max_shard_size=size_given, merge_adapters=merge_adapters)
    directory, tmp = open_directory(wm, directory, call, problems,
                                    "Pass a directory whose parent exists and is writable, and a size such as '5GB'.")
    rank0 = writes_files(wm)
    if merge_adapters:
        try:  # every pipeline stage's LoRA layers; a refusal on any rank or stage raised on all of them
            plan = joined_fold_plan(wm, plan, refused)
        except BaseException:
            if rank0 and tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    # Writers: the first replica's ranks, when they all see the temporary directory (shared
    # storage); otherwise rank 0 alone writes every file.
    me = wm.rank if first_replica(wm) else -1
    writers = wm.world_size if wm.distributed else 1
    if any_over_models(me >= 0 and not os.path.isdir(tmp), wm):
        writers, me = 1, (0 if rank0 else -1)
    live = {t.untyped_storage().data_ptr() for _, t in wm.placement.tensors() if t.numel()}
    writer = _Writer(tmp, me, writers, live) if me >= 0 else None
    weight_map: dict[str, int] = {}
    k = size = total = 0
    with torch.no_grad():
        for name, t in entries():
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > limit:
                if writer is not None and writer.owns(k):
                    writer.close(k)
                k, size = k + 1, 0
            size, total = size + nbytes, total + nbytes
            weight_map[name] = k
            if writer is not None and writer.owns(k):
                writer.add(name, t)
    n = k + 1
    if writer is not None:
        if writer.owns(k):
            writer.close(k)
        writer.finish(n)
    error = writer.error if writer is not None else None

    def finish(tmp: str) -> None:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: _file_name(f, n) for name, f in weight_map.items()}}
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _config_files(wm, tmp, base_keys, layout)

    commit_directory(wm, "save_pretrained", directory, tmp, error, finish)
