"""The module inside a wrapper, handed to ``adapt()`` without the wrapper (``engine.module``, ``fsdp.module``, a
trainer's ``self.model``), on two gloo ranks: read through the DeepSpeed engine found to hold it, exactly as the
engine is, or refused with a typed error. Never a bare read of a shard or a placeholder."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.exchange.scenarios_families import _differences, _files
from wrapkit.cli._families import family_inputs, family_model
from wrapkit.cli._models import build, fill_adapters


def _twin_files(twin: Any, peft: bool) -> dict[str, torch.Tensor]:
    """transformers' own save of the unsharded twin (merged by PEFT where it has adapters), on every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        root = tempfile.mkdtemp()
        try:
            (copy.deepcopy(twin).merge_and_unload() if peft else twin).save_pretrained(root)
            box[0] = _files(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def _saved(wm: Any, peft: bool) -> dict[str, torch.Tensor]:
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        # A bare module is each process's own: every rank saves it, each into a directory of its own.
        out = os.path.join(str(box[0]), "saved" if wm.world_size > 1 else f"saved-{dist.get_rank()}")
        wm.save_pretrained(out, merge_adapters=peft)
        return _files(out)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(box[0]), ignore_errors=True)


def _tokens(wm: Any, ids: torch.Tensor) -> list[list[int]]:
    with torch.no_grad(), wm.generation() as m:
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    return out.tolist()  # type: ignore[no-any-return]


def _step(outer: Any, inputs: dict[str, torch.Tensor], optimizer: Any) -> None:
    """One training step the way each wrapper takes it (DeepSpeed's engine steps its own optimizer)."""
    loss = outer(**inputs, labels=inputs["input_ids"]).loss
    if optimizer is None:
        outer.backward(loss)
        outer.step()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _read(case: dict[str, Any]) -> dict[str, Any]:
    spec, family, peft = case["spec"], case["family"], case.get("peft", False)
    model: Any = family_model(family, 1)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = fill_adapters(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
                              seed=5)
    # Before ZeRO-3 partitions it; a 16-bit engine starts its fp32 masters from the weights it cast to bf16 (and
    # LoRA folds in fp32, rounded once at the end).
    twin = copy.deepcopy(model)
    if case.get("precision") == "bf16":
        twin = twin.to(torch.bfloat16).float()
    outer: Any = build(spec, model=model, precision=case.get("precision", "fp32"))
    optimizer = None
    if not spec.startswith("zero"):
        optimizer = torch.optim.SGD([p for p in outer.parameters() if p.requires_grad], lr=0.5)
    inner = outer.module
    wm, whole = wrapkit.adapt(inner), wrapkit.adapt(outer)
    inputs = family_inputs(wm.unwrap())
    obs: dict[str, Any] = {"backend": wm.backend, "stack": list(wm.stack), "module_is_inner": wm.module is inner,
                           "given": [line for line in wm.describe().splitlines() if line.startswith("given:")]}
    oracle = _twin_files(twin, peft)
    saved = _saved(wm, peft)
    obs["save_as_wrapper"] = _differences(saved, _saved(whole, peft))
    # ZeRO-0's 16-bit optimizer starts masters of its own, neither the fp32 weights nor their bf16 rounding: there
    # the wrapper's own save is the oracle.
    obs["save"] = [] if spec == "zero0" and case.get("precision") == "bf16" else _differences(saved, oracle, cast=True)
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=4096, merge_adapters=peft)
                for n, t in b.named_tensors()}
    obs["stream"] = _differences(streamed, {n: saved[n] for n in streamed}, cast=True) + [
        f"not streamed {n}" for n in sorted(set(saved) - set(streamed))]
    obs["tokens"] = _tokens(wm, inputs["input_ids"][:, :4]) == _tokens(whole, inputs["input_ids"][:, :4])
    # After a training step through the wrapper, then after a load through the inside: the engine reads the same.
    _step(outer, inputs, optimizer)
    obs["after_step"] = _differences(wm.full_state_dict(rank0_only=False), whole.full_state_dict(rank0_only=False))
    halved = {k: v * 0.5 if v.is_floating_point() else v for k, v in whole.full_state_dict(rank0_only=False).items()}
    wm.load_full_state_dict(halved)
    obs["load"] = _differences(whole.full_state_dict(rank0_only=False), halved, cast=True)
    _step(outer, inputs, optimizer)  # the engine steps on from what was loaded
    obs["step_after_load"] = bool(_differences(whole.full_state_dict(rank0_only=False), halved, cast=True))
    if peft and spec.startswith("zero"):
        # Deeper than engine.module: DeepSpeed's hooks sit on the PEFT model only, so the engine is looked up.
        deep = inner.base_model.model
        t0 = time.perf_counter()
        below = wrapkit.adapt(deep)
        obs["deep_seconds"] = time.perf_counter() - t0
        obs["deep_backend"] = below.backend
        mine = below.full_state_dict(rank0_only=False)
        theirs = whole.full_state_dict(rank0_only=False)
        obs["deep"] = _differences(mine, {k: theirs[f"base_model.model.{k}"] for k in mine if
                                          f"base_model.model.{k}" in theirs}) if mine else ["nothing read"]
    return obs


def inside_reads(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each case ``{"spec", "family", "precision", "peft"}``: ``adapt(outer.module)`` against transformers' save
    of an unsharded twin, the wrapper's own adapter, after a step and after a load."""
    from tests.harness._matrix import key

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return {key(case): _read(case) for case in cases}


def _refusal(model: torch.nn.Module) -> str:
    try:
        wm = wrapkit.adapt(model)
    except wrapkit.WrapkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"adapted as {wm.backend}"


def _fsdp1(use_orig_params: bool, per_block: bool, peft: bool) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model: Any = family_model("llama", 0)
    blocks = {type(model.model.layers[0])}
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                                    auto_wrap_policy=ModuleWrapPolicy(blocks) if per_block else None)


def inside_refusals() -> dict[str, str]:
    """What ``adapt()`` says of insides it cannot read whole: FSDP1's (flattened, per block or at the root only,
    with PEFT inside), and deep copies of a module inside an engine."""
    out: dict[str, str] = {}
    for uop in (True, False):
        for per_block in (True, False):
            out[f"fsdp uop={uop} per_block={per_block}"] = _refusal(_fsdp1(uop, per_block, False).module)
    out["fsdp peft"] = _refusal(_fsdp1(True, True, True).module)
    out["fsdp root"] = _refusal(_fsdp1(True, True, False))
    # Deep copies (a reference made by hand): ZeRO-2's holds whole weights of its own, ZeRO-3's only placeholders.
    for stage in ("zero2", "zero3"):
        engine = build(stage, model=family_model("llama", 0))
        try:
            twin = copy.deepcopy(engine.module)
        except TypeError as exc:  # DeepSpeed 0.16's ZeRO-3 hooks cannot be copied: no copy to read
            out[f"{stage} deep copy"] = f"deepcopy raised {exc}"
            continue
        said = _refusal(twin)
        if said == "adapted as plain":
            mine = wrapkit.adapt(twin).full_state_dict(rank0_only=False)
            theirs = wrapkit.adapt(engine).full_state_dict(rank0_only=False)
            said += " " + str(_differences(mine, theirs))
        out[f"{stage} deep copy"] = said
    # FSDP2 and tensor parallelism shard in place: the module below the root (PEFT's base model, the decoder)
    # holds DTensors, read whole from their placements.
    for spec, below, prefix in (("fsdp2>peft", lambda m: m.base_model.model, "base_model.model."),
                                ("tp", lambda m: m.model, "model.")):
        outer = build(spec)
        mine = wrapkit.adapt(below(outer)).full_state_dict(rank0_only=False)
        theirs = wrapkit.adapt(outer).full_state_dict(rank0_only=False)
        out[f"{spec} below the root"] = str(_differences(mine, {k: theirs[prefix + k] for k in mine}) + [
            f"missing {k}" for k in theirs if k.startswith(prefix) and k[len(prefix):] not in mine])
    return out
