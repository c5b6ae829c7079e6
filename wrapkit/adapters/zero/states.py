"""A DeepSpeed engine's training state off the device and back (``sleep`` / ``wake``), through
DeepSpeed's own ``offload_states`` / ``reload_states``, which keep its flat buffers and the views
into them consistent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._errors import UnsupportedModelError

__all__ = ["sleep_way", "offload_engine_states"]


def sleep_way(stage: int, optimizer: Any) -> str | None:
    """"torch": ZeRO-0 with a torch optimizer, moved as any module; "engine": DeepSpeed's
    ``offload_states`` moves everything; "engine+state": it moves all but the fp32 masters and the
    optimizer's state, which its ZeRO-3 moves only for its own FusedAdam (moved here); None: no way
    (ZeRO-1/2 before DeepSpeed 0.17, another optimizer than FusedAdam under ZeRO-3 before 0.17, or
    no optimizer)."""
    if stage == 0 and isinstance(optimizer, torch.optim.Optimizer):
        return "torch"
    if optimizer is None or not callable(getattr(optimizer, "offload_states", None)):
        return None
    if stage == 3 and type(getattr(optimizer, "optimizer", None)).__name__ != "FusedAdam":
        # Before 0.17 DeepSpeed's ZeRO-3 refused to offload anything for another optimizer.
        return "engine+state" if _deepspeed_version() >= (0, 17) else None
    return "engine"


def offload_engine_states(engine: Any, stage: int, home: torch.device) -> Callable[[], None] | None:
    """Move ``engine``'s states to the CPU; returns what brings them back to ``home`` (None for the
    "torch" way: the caller moves the module and the optimizer's state)."""
    optimizer: Any = getattr(engine, "optimizer", None)
    way = sleep_way(stage, optimizer)
    if way == "torch":
        return None
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    include = set(OffloadStateTypeEnum)
    if way == "engine+state":
        include -= {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params}
    # ZeRO-3 forgets which gradient partitions the next step reads when it moves them (its
    # offload clears ``averaged_gradients``): rebuilt on reload when a step is pending.
    pending = stage == 3 and bool(getattr(optimizer, "averaged_gradients", None))
    try:
        engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=home.type == "cuda")
    except AssertionError as exc:  # DeepSpeed's own refusal, raised before it moves anything
        raise UnsupportedModelError(f"DeepSpeed cannot offload this ZeRO-{stage} engine's states ({exc}); use "
                                    "place('cpu') to move the parameters alone") from exc
    state: list[tuple[dict[str, Any], str]] = []
    if way == "engine+state":  # what DeepSpeed leaves to its FusedAdam: moved here, after it succeeded
        for flat in optimizer.fp32_partitioned_groups_flat:
            flat.data = flat.data.to("cpu")
        state = [(st, key) for st in optimizer.optimizer.state.values() for key, value in st.items()
                 if isinstance(value, torch.Tensor) and value.device == home]
        for st, key in state:
            st[key] = st[key].to("cpu")

    def reload() -> None:
        engine.reload_states()
        for flat in optimizer.fp32_partitioned_groups_flat if way == "engine+state" else ():
            flat.data = flat.data.to(home)
        for st, key in state:
            st[key] = st[key].to(home)
        if pending:
            by_id = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
            for i, group in enumerate(optimizer.fp16_groups):
                optimizer.averaged_gradients[i] = [by_id[p.ds_id] if p.requires_grad
                                                   else torch.zeros_like(p.ds_tensor) for p in group]
    return reload


def _deepspeed_version() -> tuple[int, int]:
    import deepspeed

    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in deepspeed.__version__.split(".")[:2])
    return major, minor
