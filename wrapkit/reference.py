"""The frozen reference model of DPO, online DPO, GRPO and PPO,
sharded and placed the way the policy is.

What a trainer used to get wrong, and what this module does instead:

* handing ``None`` to a backend (``deepspeed.initialize(model=None)``) when PEFT made a
  separate reference unnecessary: a ``None`` reference is built here, as a view of the
  policy with its adapters off or as a fresh frozen copy of its weights;
* "preparing" a reference in evaluation mode by skipping wrapping and placement: the
  reference here is always wrapped like the policy and verified on its compute device.

A fresh copy of a sharded policy is built as an empty skeleton that is sharded first and
filled from the policy's own shards (ZeRO-3 partitions, FSDP2 DTensors, FSDP1 sharded
state dict), so no rank ever holds the full model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ._agree import Call, enter
from ._errors import ReferenceModelError
from ._imports import require
from ._names import canonical_name
from ._registry import as_adapter
from ._torch_ops import keep_torch_ops
from .adapters import Adapter
from .adapters._base import model_class_name
from .adapters._zero_partitions import settle_gathers
from .placement import to_eval_frozen
from .view import AdapterDisabledView, view_possible
from .wrapping import fsdp1_like, fsdp2_like, policy_mpu, reference_ds_config, wrap_like

__all__ = ["build_reference", "AdapterDisabledView"]


def build_reference(policy: Any, ref_model: Any = None, *,
                    ds_config: dict[str, Any] | None = None) -> Adapter | AdapterDisabledView:
    """The reference ``prepare_reference`` hands out (see its docstring there)."""
    pol = as_adapter(policy, "using it as the policy of another reference")
    misplaced = ds_config is not None and pol.backend != "deepspeed"
    shared = ref_model is not None and not misplaced and _shares_parameters(pol, ref_model)
    # The entry: what kind of reference is asked for must match (each rank passes its own ref_model).
    call = Call.of("prepare_reference", ref_model=ref_model is not None, ds_config=ds_config is not None)
    any_misplaced, any_shared = enter(call, pol, flags=[misplaced, shared], invalid=1)
    if any_misplaced:
        raise ReferenceModelError(
            f"ds_config only applies to a DeepSpeed policy, and this policy's backend is {pol.backend!r}; "
            "drop ds_config."
        )
    if ref_model is not None:
        if any_shared:
            raise ReferenceModelError(
                "ref_model is the policy or shares parameters with it, so it would train along with the "
                "policy; pass a separate model (e.g. loaded again from the same checkpoint) or None to "
                "let prepare_reference build one."
            )
        return _torch_forward(to_eval_frozen(wrap_like(pol, ref_model, ds_config)))
    if view_possible(pol):
        return AdapterDisabledView(pol)
    return _torch_forward(to_eval_frozen(_fresh_copy(pol, ds_config)))


def _torch_forward(ref: Adapter) -> Adapter:
    """A reference outside DeepSpeed runs its forward with torch's own operators, even in a process
    where a ZeRO-3 engine has replaced them (``_torch_ops``); a DeepSpeed one keeps its engine's."""
    if ref.backend != "deepspeed":
        keep_torch_ops(ref.module)
    return ref


# -- identity checks -------------------------------------------------------------------------
def _storages(module: torch.nn.Module) -> Iterator[tuple[torch.device, int]]:
    for p in module.parameters():
        local = getattr(p, "_local_tensor", p)  # a DTensor's storage is its local shard's
        if isinstance(local, torch.Tensor) and local.numel() > 0 and not local.is_meta:
            yield local.device, local.untyped_storage().data_ptr()


def _shares_parameters(pol: Adapter, ref_model: Any) -> bool:
    ref = as_adapter(ref_model, "using it as a reference")
    if ref.module is pol.module or ref.unwrap(keep_peft=False) is pol.unwrap(keep_peft=False):
        return True
    pol_root = pol.unwrap(keep_peft=True)
    ref_root = ref.unwrap(keep_peft=True)
    if {id(p) for p in pol_root.parameters()} & {id(p) for p in ref_root.parameters()}:
        return True
    return bool(set(_storages(pol_root)) & set(_storages(ref_root)))


# -- fresh frozen copies ------------------------------------------------------------------------
def _skeleton(pol: Adapter) -> torch.nn.Module:
    """An uninitialised model of the policy's class, built from its config (weights come later)."""
    inner = pol.unwrap(keep_peft=False)
    cfg = getattr(inner, "config", None)
    if "peft" in pol.stack or cfg is None:
        why = ("its PEFT model trains weights outside the adapters" if "peft" in pol.stack
               else f"{model_class_name(inner)} has no config to rebuild it from")
        raise ReferenceModelError(
            f"cannot build a reference for this sharded {pol.backend} policy without gathering it, because {why}; "
            "pass ref_model (the model loaded again from its checkpoint)."
        )
    dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), torch.float32)
    model = type(inner)(copy.deepcopy(cfg))
    return model.to(dtype)


def _fresh_copy(pol: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    if pol.backend == "deepspeed" and pol.zero_stage == 3:
        return _zero3_copy(pol, ds_config)
    if pol.backend == "fsdp":
        return _fsdp1_copy(pol)
    if pol.backend == "fsdp2":
        return _fsdp2_copy(pol)
    # Replicated backends (and ZeRO-0/1/2) hold the full weights on every rank already.
    source = pol.unwrap(keep_peft=True)
    if any(p.numel() == 0 for p in source.parameters()):
        raise ReferenceModelError(
            f"the {pol.backend} policy's parameters are not all present on this rank (offloaded or sharded); "
            "call policy.place() first or pass ref_model."
        )
    return wrap_like(pol, copy.deepcopy(source), ds_config)


def _copy_buffers(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Buffers are never sharded; non-persistent ones (rotary tables) are in no state dict."""
    theirs = {canonical_name(k): v for k, v in src.named_buffers()}
    with torch.no_grad():
        for name, buf in dst.named_buffers():
            other = theirs.get(canonical_name(name))
            if other is not None:
                buf.copy_(other)


def _fsdp2_copy(pol: Adapter) -> Adapter:
    with torch.device("meta"):
        model = _skeleton(pol)
    ref = fsdp2_like(pol, model)
    model.to_empty(device=pol.device)
    inner = pol.unwrap(keep_peft=False)
    unit: Any
    for unit in inner.modules():
        # FSDP2 leaves the root gathered after a forward; back to shards (what the next
        # forward starts from anyway) so that every parameter is a DTensor to copy from.
        if hasattr(unit, "reshard") and hasattr(unit, "_get_fsdp_state"):
            unit.reshard()
    theirs = dict(inner.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Same mesh and placements: a local copy of this rank's shard, nothing gathered.
            p.copy_(theirs[name])
    _copy_buffers(inner, model)
    return ref


def _fsdp1_copy(pol: Adapter) -> Adapter:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with torch.device("meta"):
        model = _skeleton(pol)
    ref = fsdp1_like(pol, model, init_on=pol.device)
    src: Any = pol.backend_object
    dst: Any = ref.module
    # Sharded state dicts move shard to shard, one unit at a time: the full model is never built.
    with FullyShardedDataParallel.state_dict_type(src, StateDictType.SHARDED_STATE_DICT), \
            FullyShardedDataParallel.state_dict_type(dst, StateDictType.SHARDED_STATE_DICT):
        dst.load_state_dict(src.state_dict())
    _copy_buffers(pol.unwrap(keep_peft=False), ref.unwrap(keep_peft=False))
    return ref


def _zero3_copy(pol: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    deepspeed = require("deepspeed", feature="a ZeRO-3 reference model", extra="deepspeed")
    cfg = reference_ds_config(pol, ds_config)
    group = pol.process_group()
    with deepspeed.zero.Init(config_dict_or_path=cfg, data_parallel_group=group):
        model = _skeleton(pol)
    theirs = dict(pol.unwrap(keep_peft=False).named_parameters())
    pairs: list[tuple[Any, Any]] = [(theirs[name], p) for name, p in model.named_parameters()]
    # Same group, same sizes: partitions line up and are copied locally. Agreed first, as
    # the fallback gathers (one parameter at a time).
    aligned = all(a.ds_tensor.shape == b.ds_tensor.shape for a, b in pairs)
    with torch.no_grad():
        if not pol.agree_any(not aligned):
            for a, b in pairs:
                b.ds_tensor.copy_(a.ds_tensor)
        else:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for a, b in pairs:
                with deepspeed.zero.GatheredParameters([a, b], modifier_rank=src):
                    settle_gathers([a, b])
                    if pol.rank == 0:
                        b.data.copy_(a.data)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=policy_mpu(pol))
    _copy_buffers(pol.unwrap(keep_peft=False), engine.module)
    return as_adapter(engine)
