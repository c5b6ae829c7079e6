"""FSDP1's ``FlatParameter``: where each original parameter lies in a unit's flat shard.

FSDP1 has no public per-parameter API. The private fields read here (``_fqns``, ``_params``,
``_shapes``, ``_shard_param_infos``, ``_local_shard``) are documented on ``FlatParameter`` in
torch/distributed/fsdp/_flat_param.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._names import canonical_name
from ._base import copy_into
from ._primitives import Piece

__all__ = ["local_shard", "flat_pieces"]


def local_shard(flat: Any) -> torch.Tensor:
    """This rank's (padded) shard of a unit's flat parameter. ``_local_shard`` appears at FSDP's
    lazy init (the first forward); until then the flat parameter itself holds the shard."""
    local: torch.Tensor | None = getattr(flat, "_local_shard", None)
    out: torch.Tensor = flat.data if local is None else local
    return out


def flat_pieces(root: torch.nn.Module, handles: Iterable[Any]) -> list[Piece]:
    """The ranges of original parameters that this rank's shard of each unit holds."""
    # Canonical name of each original parameter (use_orig_params=True registers them), and the
    # module path of each registered flat parameter (use_orig_params=False registers those).
    names: dict[int, str] = {}
    prefixes: dict[int, str] = {}
    for name, p in root.named_parameters():
        if getattr(p, "_fqns", None) is not None and getattr(p, "_params", None) is None:
            prefixes[id(p)] = name.rpartition(".")[0]
        else:
            names.setdefault(id(p), canonical_name(name))
    out: list[Piece] = []
    for handle in handles:
        flat = handle.flat_param
        if handle.uses_sharded_strategy and local_shard(flat).data_ptr() != flat.data_ptr():
            # Left unsharded by a forward (FSDP keeps the root so): its full copy would
            # outlive the write and be used as is by the next forward.
            handle.reshard(True)
            handle.post_reshard()
            handle._prefetched = False
        shard = local_shard(flat)
        for i, info in enumerate(flat._shard_param_infos):
            if not info.in_shard:
                continue
            if flat._params is not None:
                name = names[id(flat._params[i])]
            else:
                prefix = prefixes[id(flat)]
                name = canonical_name(f"{prefix}.{flat._fqns[i]}" if prefix else flat._fqns[i])
            dest = shard[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard]
            out.append(Piece(name, int(info.intra_param_start_idx), int(info.numel_in_shard),
                             tuple(flat._shapes[i]), copy_into(dest)))
    return out
