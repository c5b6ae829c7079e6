"""FSDP1 (``FullyShardedDataParallel``): parameters flattened into one ``FlatParameter``
per wrapped unit, each rank holding a slice of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._imports import is_instance, lookup
from ._base import Adapter


class FSDPAdapter(Adapter):
    name = "fsdp"
    distributed = True

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.distributed.fsdp", "FullyShardedDataParallel")

    def _process_group(self) -> Any:
        return getattr(self._backend_obj, "process_group", None)

    def _units(self) -> Iterator[Any]:
        """Every FSDP instance in the tree (the root included), outermost first."""
        fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
        assert self._backend_obj is not None and fsdp_cls is not None
        for m in self._backend_obj.modules():
            if isinstance(m, fsdp_cls):
                yield m

    @property
    def device(self) -> torch.device:
        dev = getattr(self._backend_obj, "compute_device", None)
        return dev if isinstance(dev, torch.device) else super().device

    @property
    def is_sharded(self) -> bool:
        strategy = getattr(self._backend_obj, "sharding_strategy", None)
        return self.world_size > 1 and getattr(strategy, "name", "") != "NO_SHARD"

    @property
    def world_size(self) -> int:
        return self._group_size_and_rank()[0]

    @property
    def rank(self) -> int:
        return self._group_size_and_rank()[1]

    def num_parameters(self, trainable_only: bool = False) -> int:
        # The original parameters live inside FlatParameters; their sizes are recorded
        # there (``_numels``, shared parameters already counted once). With
        # use_orig_params=True the original Parameters keep their own requires_grad.
        total = 0
        for unit in self._units():
            handle = getattr(unit, "_handle", None)
            if handle is None:
                continue
            flat = handle.flat_param
            originals = getattr(flat, "_params", None)
            if originals is not None:
                flags = [p.requires_grad for p in originals]
            else:
                flags = [flat.requires_grad] * len(flat._numels)
            total += sum(n for n, rg in zip(flat._numels, flags, strict=True) if rg or not trainable_only)
        return total
