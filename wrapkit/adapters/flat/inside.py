"""The module inside an FSDP1 wrapper, handed over without it.

``FullyShardedDataParallel`` flattens the parameters of the module it wraps into flat parameters that it owns,
and leaves the module's own parameters as views into this rank's shard (``use_orig_params=True``: 1-D slices, some
empty) or registers the flat parameter on it (``use_orig_params=False``). Read as a bare module, either is a
silently wrong model. torch keeps no way back from the module to its wrapper, so such a module is refused,
naming what gave it away.
"""

from __future__ import annotations

import torch

from ..._imports import lookup
from ..._names import canonical_name

__all__ = ["fsdp1_mark"]


def fsdp1_mark(model: torch.nn.Module) -> str | None:
    """What FSDP1 left on ``model``, in words, or None: a wrapper inside it (the units of an auto-wrap
    policy) or a parameter it flattened (FSDP2 marks neither)."""
    fsdp = lookup("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
    if fsdp is None:  # never imported: nothing can have been wrapped by it
        return None
    for path, module in model.named_modules():
        if isinstance(module, fsdp):
            return f"{canonical_name(path) or 'it'} is a FullyShardedDataParallel unit"
    for name, p in model.named_parameters():
        if getattr(p, "_fsdp_flattened", False) is True:
            return f"{name!r} is flattened by FullyShardedDataParallel (shape {tuple(p.shape)})"
    return None
