"""Scenarios for models bigger than one device: layerwise generation, sharded checkpoints."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import PRECISIONS, build, ds_config, tiny_llama

PROMPT = (torch.arange(12).reshape(2, 6) * 7) % 128
LAYERS = 4


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _generate(m: torch.nn.Module, new_tokens: int) -> torch.Tensor:
    out: torch.Tensor = m.generate(  # type: ignore[operator]
        PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None)
    return out


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What must be exactly the same after generation(): parameter objects, hooks, modes."""
    return {
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        "modes": [m.training for m in model.modules()],
        "dicts": [sorted(k for k in m.__dict__ if k.startswith("_is_fsdp")) for m in model.modules()],
    }


def _lean_zero3(precision: str) -> torch.nn.Module:
    """ZeRO-3 that keeps nothing gathered between forwards and prefetches little: the setting
    for a model bigger than one device (the defaults keep parameters under 1e5 elements, all
    of a tiny model's, gathered for good)."""
    import deepspeed
    from deepspeed.utils import groups

    groups.mpu = None
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1,
            "stage3_max_live_parameters": 1}
    extra = {} if precision == "fp32" else {precision: {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(0, layers=LAYERS),
                                      config=ds_config(3, zero_optimization=zero, **extra))
    return engine  # type: ignore[no-any-return]


def build_scale(spec: str, precision: str = "fp32", topology: str = "flat") -> torch.nn.Module:
    if spec == "zero3":
        return _lean_zero3(precision)
    return build(spec, model=tiny_llama(0, layers=LAYERS), precision=precision, topology=topology)


def unit_bytes(precision: str) -> list[int]:
    """Bytes of each transformer block, and of everything outside the blocks, in the compute dtype."""
    model = tiny_llama(0, layers=LAYERS)
    size = PRECISIONS[precision].itemsize
    blocks = [sum(p.numel() for p in block.parameters()) * size for block in model.model.layers]
    return [*blocks, sum(p.numel() for p in model.parameters()) * size - sum(blocks)]


def layerwise(spec: str, precision: str, topology: str = "flat") -> dict[str, Any]:
    """gather="layerwise" against "full": the same logits and tokens, the same state afterwards,
    and a peak of parameter memory far below the gathered model."""
    model = build_scale(spec, precision, topology)
    wm = wrapkit.adapt(model)
    obs: dict[str, Any] = {"full_bytes": wm._below.full_parameter_bytes(),  # type: ignore[attr-defined]
                           "rank": dist.get_rank()}
    before = _snapshot(model)
    with wm.generation(gather="full") as m:
        full_logits = _logits(m(input_ids=PROMPT))
        full_tokens = _generate(m, 6)
    peak = [0]

    def track(mod: torch.nn.Module, *args: Any) -> None:
        peak[0] = max(peak[0], wm.resident_parameter_bytes())

    obs["rest_bytes"] = wm.resident_parameter_bytes()
    try:
        with wm.generation(gather="layerwise") as m:
            # After each module's gathering hooks (registered first) and before its releasing ones.
            handles = [h for mod in m.modules()
                       for h in (mod.register_forward_pre_hook(track), mod.register_forward_hook(track))]
            try:
                obs["training_inside"] = any(x.training for x in m.modules())
                lw_logits = _logits(m(input_ids=PROMPT))
                lw_tokens = _generate(m, 6)
                # A rank that stops early keeps stepping while the other decodes (synced).
                obs["ragged"] = list(_generate(m, 3 + 3 * dist.get_rank()).shape)
            finally:
                for h in handles:
                    h.remove()
    except Exception as exc:  # reported, so every rank's failure is seen side by side
        obs["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return obs
    try:  # a body that raises mid-generation leaves nothing behind either
        with wm.generation(gather="layerwise") as m:
            m(input_ids=PROMPT)
            raise KeyError("body")
    except KeyError:
        pass
    obs["peak_bytes"] = peak[0]
    obs["logits_diff"] = float((lw_logits.float() - full_logits.float()).abs().max())
    obs["dtypes"] = (str(full_logits.dtype), str(lw_logits.dtype))
    obs["same_tokens"] = bool(torch.equal(lw_tokens, full_tokens))
    obs["same_state"] = _snapshot(model) == before
    obs["after_bytes"] = wm.resident_parameter_bytes()
    # Training still works, and its forward gives the same logits as before.
    model.eval()
    with torch.no_grad():
        obs["own_diff"] = float((_logits(wm(input_ids=PROMPT)).float() - full_logits.float()).abs().max())
    model.train()
    return obs


def auto_choice(spec: str, budget: str | None) -> dict[str, Any]:
    """gather="auto" under a memory budget: full when the model fits, layerwise when it does not;
    gathered() refuses the model that does not fit, on every rank, with nothing changed."""
    wm = wrapkit.adapt(build_scale(spec))
    if budget is not None:
        os.environ["WRAPKIT_MEMORY_BUDGET"] = budget
    obs: dict[str, Any] = {}
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("wrapkit")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        full_tokens = None
        with wm.generation(gather="auto") as m:
            full_tokens = _generate(m, 4)
        obs["chosen"] = records
        try:
            with wm.gathered():
                obs["gathered"] = "entered"
        except wrapkit.PlacementError as exc:
            obs["gathered"] = str(exc)
        try:
            with wm.generation(gather="full"):
                obs["full"] = "entered"
        except wrapkit.PlacementError as exc:
            obs["full"] = str(exc)
        try:
            with wm.generation(gather="sideways" if dist.get_rank() == 1 else "auto"):
                obs["bad"] = "entered"
        except wrapkit.ArgumentError as exc:
            obs["bad"] = str(exc)
        with wm.generation(gather="layerwise") as m:
            obs["same_tokens"] = bool(torch.equal(_generate(m, 4), full_tokens))
        obs["training"] = wm.module.training
    finally:
        os.environ.pop("WRAPKIT_MEMORY_BUDGET", None)
        logger.removeHandler(handler)
        logger.setLevel(level)
    return obs
