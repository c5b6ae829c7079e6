"""A DeepSpeed engine's training state as ``save_state`` / ``load_state`` read it: the fp32 masters and the
optimizer's moments live in flat partitions of the engine's optimizer, one per param group, each rank holding
its range of every group; the torch optimizer inside steps those flat tensors.

- ZeRO-1/2 (and the bf16 optimizer): each 16-bit parameter carries ``_hp_mapping``, DeepSpeed's own link to
  its fragment (``lp_fragment_address``: where the fragment lies in the flattened parameter;
  ``hp_fragment_address``: where in the flat partition). After a load, ``update_lp_params`` copies the masters
  into the 16-bit weights and all-gathers them.
- ZeRO-0 with 16-bit weights (the unfused optimizer): one fp32 parameter per 16-bit one, stepped whole; after a
  load the 16-bit weights take their values.
- ZeRO-3: each parameter's partition is a range of the padded flattened parameter (rank ``r`` holds
  ``[r * size, (r + 1) * size)``), and its place in the group's flat partition is the optimizer's
  ``grad_position`` entry for it. After a load the 16-bit partitions take the masters' values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._errors import UnsupportedModelError
from ..._names import canonical_name
from ..core.parts import Held

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["ZeroResume", "zero_resume"]


def _per_element(value: Any, flat: torch.Tensor) -> bool:
    return torch.is_tensor(value) and tuple(value.shape) == tuple(flat.shape)


class ZeroResume:
    """ZeRO 1-3's training state (``Resume``)."""

    def __init__(self, model: Adapter, engine: Any) -> None:
        self.model, self.engine = model, engine
        self.zero = engine.optimizer
        self.stage3 = model.zero_stage == 3
        # ZeRO-0 with 16-bit weights: one fp32 parameter per 16-bit one, group by group, stepped whole.
        self.unfused = not self.stage3 and not hasattr(self.zero, "bit16_groups") and \
            not hasattr(self.zero, "bf16_groups")
        names: dict[int, str] = {}
        for name, p in model.unwrap().named_parameters():
            names.setdefault(id(p), canonical_name(name))
        self.names = names

    def _groups(self) -> list[tuple[list[Any], torch.Tensor]]:
        """(The 16-bit parameters, this rank's flat fp32 partition) of each param group."""
        if self.stage3:
            return list(zip(self.zero.fp16_groups, self.zero.fp32_partitioned_groups_flat, strict=True))
        lows = getattr(self.zero, "bit16_groups", None) or self.zero.bf16_groups
        flats = getattr(self.zero, "single_partition_of_fp32_groups", None) or self.zero.fp32_groups_flat_partition
        return list(zip(lows, flats, strict=True))

    def optimizer(self) -> Any:
        return self.zero.optimizer

    def group_names(self) -> list[list[str]]:
        if self.unfused:
            return [[self.names[id(p)] for p in params] for params in self.zero.fp16_groups]
        return [[self.names[id(p)] for p in params] for params, _ in self._groups()]

    def _pairs(self) -> list[tuple[Any, torch.Tensor]]:
        """(16-bit parameter, its fp32 master) of the unfused optimizer."""
        return [(low, high) for lows, highs in zip(self.zero.fp16_groups, self.zero.fp32_groups, strict=True)
                for low, high in zip(lows, highs, strict=True)]

    def held(self) -> list[Held]:
        if self.stage3 and getattr(self.zero, "swap_optimizer", False):
            raise UnsupportedModelError(
                "this ZeRO-3 engine swaps its optimizer state out to NVMe; save_state and load_state read it in "
                "memory only (offload it to the CPU instead)")
        out: list[Held] = []
        if self.unfused:
            for low, high in self._pairs():
                state = self.zero.optimizer.state.get(high, {})
                per = {k: v.detach().view(-1) for k, v in state.items() if _per_element(v, high)}
                out.append(Held(self.names[id(low)], tuple(low.shape), 0, low.numel(), high.detach().view(-1), per,
                                {k: v for k, v in state.items() if k not in per}, high))
            return out
        for params, flat in self._groups():
            state = self.zero.optimizer.state.get(flat, {})
            per_element = {k: v for k, v in state.items() if _per_element(v, flat)}
            scalars = {k: v for k, v in state.items() if k not in per_element and torch.is_tensor(v)}
            for p in params:
                found = self._stage3_range(p, flat) if self.stage3 else self._fragment(p)
                if found is None:
                    continue
                start, numel, at = found
                weights = flat.narrow(0, at, numel)
                out.append(Held(self.names[id(p)], tuple(self._full_shape(p)), start, numel, weights,
                                {k: v.narrow(0, at, numel) for k, v in per_element.items()}, scalars, flat))
        return out

    def _full_shape(self, p: Any) -> tuple[int, ...]:
        return tuple(getattr(p, "ds_shape", p.shape))

    def _fragment(self, p: Any) -> tuple[int, int, int] | None:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return None
        lp, hp = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
        if not lp.numel:
            return None
        return int(lp.start), int(lp.numel), int(hp.start)

    def _stage3_range(self, p: Any, flat: torch.Tensor) -> tuple[int, int, int] | None:
        # Where the optimizer keeps this parameter's partition in its group's flat one (as its own readers find it).
        _, at, _ = self.zero.grad_position[self.zero.get_param_id(p)]
        size = int(p.ds_tensor.ds_numel)
        start = dist.get_rank(p.ds_process_group) * size
        valid = max(0, min(size, int(p.ds_numel) - start))
        if not valid:
            return None
        return start, valid, int(at)

    def create(self, keys: Mapping[str, Mapping[str, tuple[bool, torch.dtype, tuple[int, ...]]]]) -> None:
        # DeepSpeed's optimizer makes its state at its first step, over each group's flat partition.
        state = self.zero.optimizer.state
        if self.unfused:
            for low, high in self._pairs():
                for key, (per_element, dtype, shape) in keys.get(self.names[id(low)], {}).items():
                    if key not in state[high]:
                        state[high][key] = (torch.zeros_like(high, dtype=dtype) if per_element
                                            else torch.zeros(shape, dtype=dtype))
            return
        for params, flat in self._groups():
            st = state[flat]
            for p in params:
                for key, (per_element, dtype, shape) in keys.get(self.names[id(p)], {}).items():
                    if key not in st:
                        st[key] = (torch.zeros_like(flat, dtype=dtype) if per_element
                                   else torch.zeros(shape, dtype=dtype))
        # DeepSpeed links each parameter to its fragment of the new state lazily (its own readers need it).
        link = getattr(self.zero, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link):
            link()

    def loaded(self) -> None:
        with torch.no_grad():
            if self.unfused:
                for low, high in self._pairs():
                    low.data.copy_(high.data)
            elif self.stage3:
                for low, high in zip(self.zero.fp16_partitioned_groups_flat, self.zero.fp32_partitioned_groups_flat,
                                     strict=True):
                    low.data.copy_(high.data)
            else:
                self.zero.update_lp_params()


def zero_resume(model: Adapter, engine: Any) -> ZeroResume | None:
    """The engine's training state where a ZeRO or bf16 optimizer keeps it; None where the engine's optimizer is
    the torch optimizer itself over the module's parameters (ZeRO-0 in fp32), or there is none."""
    zero = getattr(engine, "optimizer", None)
    if zero is None or not hasattr(zero, "optimizer"):
        return None
    if model.zero_stage == 3 or any(hasattr(zero, f) for f in ("bit16_groups", "bf16_groups", "fp32_groups")):
        return ZeroResume(model, engine)
    return None
