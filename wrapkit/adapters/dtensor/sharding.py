"""How FSDP2 is applied for the recipes, references and tests: one unit per block and one at the root, beside a
tensor-parallel mesh, with the casts of mixed precision as hooks."""

from __future__ import annotations

from typing import Any

import torch

from ..._names import canonical_name
from ..core.likeness import block_classes, resolve_units
from .layout import (
    mesh_key,
)

__all__ = ["_beside", "_cast", "_cast_hooks", "_reshard_root", "fully_shard_per_block", "param_groups",
           "shard_fsdp2", "unit_groups"]


def _beside(mesh: Any, tp_mesh: Any) -> str | None:
    """Why ``tp_mesh`` is not fully_shard's ``mesh`` with one tensor-parallel dimension after it (None: it is)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if tp_mesh.ndim != mesh.ndim + 1:
        return (f"tensor parallelism beside fully_shard over {tp_mesh.ndim - mesh.ndim} mesh dimensions, a layout "
                "the fsdp2 adapter cannot read (one tensor-parallel dimension after fully_shard's)")
    full_names = getattr(tp_mesh, "mesh_dim_names", None) or ()
    if not names or tuple(full_names[: mesh.ndim]) != tuple(names) or mesh_key(tp_mesh[names]) != mesh_key(mesh):
        return ("the tensor-parallel mesh does not begin with fully_shard's mesh, a layout the fsdp2 adapter "
                "cannot read (slice both from one named mesh: mesh['dp'] for fully_shard, mesh['tp'] for "
                "parallelize_module)")
    return None


def fully_shard_per_block(module: torch.nn.Module, mesh: Any, **kwargs: Any) -> torch.nn.Module:
    """FSDP2 the usual way: ``fully_shard`` each transformer block, then the root."""
    from torch.distributed.fsdp import fully_shard

    block_types = tuple(block_classes(module))
    for m in list(module.modules()):
        if block_types and isinstance(m, block_types):
            fully_shard(m, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return module


def unit_groups(root: torch.nn.Module) -> list[list[str]]:
    """The modules ``fully_shard`` was applied to under ``root`` (the root left out), by canonical path, grouped
    as they were sharded together (``fully_shard([norm, output])`` makes one group), children before parents."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, list[str]] = {}
    for path, m in root.named_modules():
        if path and isinstance(m, FSDPModule):
            groups.setdefault(id(m._get_fsdp_state()), []).append(canonical_name(path))
    return list(reversed(groups.values()))  # named_modules goes parents first


def shard_fsdp2(module: torch.nn.Module, mesh: Any, groups: list[list[str]] | None = None,
                **kwargs: Any) -> torch.nn.Module:
    """FSDP2 for a frozen model: ``fully_shard`` on the modules of ``groups`` (a policy's ``unit_groups``: the
    reference is sharded where the policy is, whatever its model), else per transformer block; then the root,
    resharded after every forward."""
    from torch.distributed.fsdp import fully_shard

    found = resolve_units(module, groups or [])
    if found is None:
        fully_shard_per_block(module, mesh, **kwargs)
    else:
        for mods in found:
            fully_shard(mods if len(mods) > 1 else mods[0], mesh=mesh, **kwargs)
        fully_shard(module, mesh=mesh, **kwargs)
    # FSDP2 keeps the root's parameters gathered after forward, for the backward that a
    # frozen reference never runs: give that memory back after every forward.
    module.register_forward_hook(_reshard_root)
    return module


def _reshard_root(module: Any, args: Any, output: Any) -> None:
    module.reshard()


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in newer torch, one group or None in torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    """Every floating-point tensor in ``tree`` (nested containers, dataclasses, model outputs) cast to ``dtype``."""
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree)


def _cast_hooks(module: torch.nn.Module, state: Any) -> list[Any]:
    """Hooks casting ``module``'s inputs and outputs as its ``MixedPrecisionPolicy`` says."""
    policy = getattr(state, "_mp_policy", None)
    handles = []
    if policy is not None and policy.cast_forward_inputs and policy.param_dtype is not None:
        def cast_inputs(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            if hasattr(state, "_cast_forward_inputs"):
                return state._cast_forward_inputs(args, kwargs)
            return _cast(policy.param_dtype, args), _cast(policy.param_dtype, kwargs)
        handles.append(module.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if policy is not None and policy.output_dtype is not None:
        def cast_output(mod: torch.nn.Module, args: Any, output: Any) -> Any:
            if hasattr(state, "_cast_output_dtype"):
                return state._cast_output_dtype(output)
            return _cast(policy.output_dtype, output)
        handles.append(module.register_forward_hook(cast_output))
    return handles
