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

from collections.abc import Iterator
from typing import Any

import torch

from .._agree import Call, enter
from .._errors import ReferenceModelError
from .._registry import as_adapter
from ..adapters import Adapter
from ..adapters.core.parts import lacking, local_tensor
from ..base.torch_ops import keep_torch_ops
from .placement import to_eval_frozen
from .view import AdaptersOff, view_possible
from .wrapping import wrap_like

__all__ = ["build_reference"]


def build_reference(policy: Any, ref_model: Any = None, *,
                    ds_config: dict[str, Any] | None = None) -> Adapter:
    """The reference ``prepare_reference`` hands out (see its docstring there)."""
    pol = as_adapter(policy, "using it as the policy of another reference")
    misplaced = ds_config is not None and not (pol.likeness is not None and pol.likeness.takes_config)
    # Adapted once, here: everything below works on this adapter.
    ref = as_adapter(ref_model, "using it as a reference") if ref_model is not None and not misplaced else None
    shared = ref is not None and _shares_parameters(pol, ref)
    # The entry: what kind of reference is asked for must match (each rank passes its own ref_model).
    call = Call.of("prepare_reference", ref_model=ref_model is not None, ds_config=ds_config is not None)
    any_misplaced, any_shared = enter(call, pol, flags=[misplaced, shared], invalid=1)
    if any_misplaced:
        raise ReferenceModelError(
            f"ds_config only applies to a DeepSpeed policy, and this policy's backend is {pol.backend!r}; "
            "drop ds_config."
        )
    if ref is not None:
        if any_shared:
            raise ReferenceModelError(
                "ref_model is the policy or shares parameters with it, so it would train along with the "
                "policy; pass a separate model (e.g. loaded again from the same checkpoint) or None to "
                "let prepare_reference build one."
            )
        return _torch_forward(to_eval_frozen(wrap_like(pol, ref, ds_config)))
    if view_possible(pol):
        return AdaptersOff(pol)
    return _torch_forward(to_eval_frozen(_fresh_copy(pol, ds_config)))


def _torch_forward(ref: Adapter) -> Adapter:
    """A reference outside DeepSpeed runs its forward with torch's own operators, even in a process
    where a ZeRO-3 engine has replaced them (``base/torch_ops.py``); a DeepSpeed one keeps its engine's."""
    if ref.likeness is None or not ref.likeness.own_ops:
        keep_torch_ops(ref.module)
    return ref


# -- identity checks -------------------------------------------------------------------------
def _storages(module: torch.nn.Module) -> Iterator[tuple[torch.device, int]]:
    for p in module.parameters():
        local = local_tensor(p)  # a DTensor's storage is its local shard's
        if local.numel() > 0 and not local.is_meta:
            yield local.device, local.untyped_storage().data_ptr()


def _shares_parameters(pol: Adapter, ref: Adapter) -> bool:
    if ref.module is pol.module or ref.unwrap(keep_peft=False) is pol.unwrap(keep_peft=False):
        return True
    pol_root = pol.unwrap(keep_peft=True)
    ref_root = ref.unwrap(keep_peft=True)
    if {id(p) for p in pol_root.parameters()} & {id(p) for p in ref_root.parameters()}:
        return True
    return bool(set(_storages(pol_root)) & set(_storages(ref_root)))


# -- fresh frozen copies ------------------------------------------------------------------------
def _fresh_copy(pol: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    """A frozen copy of the policy's weights wrapped like it: its backend builds it (a sharded one
    shard to shard, so no rank ever holds the full model)."""
    if pol.likeness is None:
        raise lacking(pol.backend, "likeness.copy")
    return as_adapter(pol.likeness.copy(ds_config))
