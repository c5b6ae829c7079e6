"""Scenarios for the model-family matrix: what wrapkit writes, reads and streams against what transformers'
own ``save_pretrained`` writes for the same weights (the Hub's layout), on every backend (run on every
rank of a worker group)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

import wrapkit
from wrapkit.cli._families import family_inputs, family_model
from wrapkit.cli._models import build
from wrapkit.cli._workers import next_case
from wrapkit.integrations.vllm import load_into


@contextlib.contextmanager
def _shared_root() -> Iterator[str]:
    """A directory every rank sees (made by rank 0), removed once every rank is done with it."""
    import torch.distributed as dist

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        yield str(box[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(box[0]), ignore_errors=True)


def _files(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], cast: bool = False) -> list[str]:
    """What keeps ``got`` from being ``want`` bit for bit (``cast``: in ``got``'s dtypes)."""
    out = [f"missing {k}" for k in sorted(set(want) - set(got))]
    out += [f"unexpected {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        w = want[k].to(got[k].dtype) if cast else want[k]
        if got[k].dtype != w.dtype or got[k].shape != w.shape or not torch.equal(got[k], w):
            out.append(f"{k}: {got[k].dtype} {tuple(got[k].shape)} vs {w.dtype} {tuple(w.shape)}")
    return out


@contextlib.contextmanager
def _bytes_read() -> Iterator[list[int]]:
    """``[bytes this rank read, bytes in the checkpoint]`` of the load inside, from its debug log."""
    found: list[int] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("load: rank"):
                found[:] = [int(record.args[1]), int(record.args[2])]  # type: ignore[index]

    log = logging.getLogger("wrapkit")
    handler, level = Catch(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _wrapped(case: dict[str, Any], seed: int) -> Any:
    return wrapkit.adapt(build(case["spec"], model=family_model(case["family"], seed),
                               precision=case.get("precision", "fp32")))


def _logits(wm: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), wm.generation() as inner:  # in eval mode: T5 drops out in training
        out = inner(**{k: v.to(wm.device) for k, v in inputs.items()})
    return out.logits.detach().float().cpu()  # type: ignore[no-any-return]


def _exchange(case: dict[str, Any], root: str, rank: int) -> dict[str, Any]:
    """One case of ``family_exchange``."""
    import torch.distributed as dist

    wm = _wrapped(case, 1)
    fsd = wm.full_state_dict(rank0_only=False)
    # A plain model is each process's own, and so is the directory it saves; every rank holds the
    # same weights, so transformers' save (which writes from global rank 0 only) serves them all.
    owner = rank if case["spec"] == "plain" else 0
    base = os.path.join(root, "-".join(str(v) for v in case.values()))
    ours, theirs = base + f"-wrapkit-{owner}", base + "-transformers"
    if rank == 0:
        oracle = family_model(case["family"], 0).to(next(iter(fsd.values())).dtype)
        oracle.load_state_dict(fsd)
        oracle.save_pretrained(theirs)
    dist.barrier()
    wm.save_pretrained(ours)
    saved = _files(theirs)
    obs: dict[str, Any] = {"rank": rank, "save": _differences(_files(ours), saved)}
    inputs = family_inputs(wm.unwrap())
    logits = _logits(wm, inputs)
    for how, src_rank in (("each", None), ("src0", 0)):
        target = _wrapped(case, 2)
        with _bytes_read() as read:
            target.load(theirs, src_rank=src_rank)
        if how == "each":
            obs["read_fraction"] = read[0] / read[1] if read else None
        obs[f"load_{how}"] = _differences(target.full_state_dict(rank0_only=False), fsd)
        obs[f"logits_{how}"] = float((_logits(target, inputs) - logits).abs().max())
        inner = target.unwrap(keep_peft=False)
        tied = getattr(inner, "all_tied_weights_keys", {}) or {}
        if case["spec"] == "plain":
            obs[f"tied_{how}"] = all(inner.get_parameter(t) is inner.get_parameter(s) for t, s in tied.items())
    # The runtime layout's own ways in: a full state dict, a copy and an EMA from the policy.
    target = _wrapped(case, 2)
    target.load_full_state_dict(fsd)
    obs["load_full_state_dict"] = _differences(target.full_state_dict(rank0_only=False), fsd)
    target = _wrapped(case, 2)
    before = target.full_state_dict(rank0_only=False)
    wm.copy_to(target, alpha=0.5)
    ema = target.full_state_dict(rank0_only=False)
    want = {k: v.lerp(fsd[k], 0.5) if v.is_floating_point() else fsd[k] for k, v in before.items()}
    obs["ema"] = max(float((ema[k].double() - want[k].double()).abs().max()) for k in want)
    wm.copy_to(target)
    obs["copy_to"] = _differences(target.full_state_dict(rank0_only=False), fsd)
    tied = getattr(target.unwrap(keep_peft=False), "all_tied_weights_keys", {}) or {}
    obs["ema_tied"] = all(torch.equal(ema[t], ema[s]) for t, s in tied.items())
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=4096)
                for n, t in b.named_tensors()}
    buffers = {wrapkit.canonical_name(b) for b, _ in wm.unwrap().named_buffers()}
    params = {n for n in saved if n not in buffers}
    obs["stream"] = _differences(streamed, {n: saved[n] for n in params}, cast=True)
    for layout in ("hub", "runtime"):
        fresh = family_model(case["family"], 3).to(next(iter(fsd.values())).dtype)
        load_into(fresh, wm.stream_full_parameters(bucket_bytes=4096, layout=layout))
        # Compared in the module's own state-dict names (its hooks' where it has them: llama-fused).
        got = {n: t for n, t in fresh.state_dict().items() if n not in buffers}
        want = {n: fsd[n] for n in got}
        obs[f"load_into_{layout}"] = _differences(got, want, cast=True)
    return obs


def family_exchange(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For each case ``{"family", "spec", "precision"}``: transformers' own save of the wrapped model's
    weights is the oracle for wrapkit's ``save_pretrained`` (key set and values), for ``load`` (every
    rank reading, and rank 0 reading for all), and for the default stream's names and values; both
    stream layouts load into a fresh transformers module."""
    import torch.distributed as dist

    from tests.harness._matrix import key

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with _shared_root() as root:
        for case in cases:
            out[key(case)] = _exchange(case, root, rank)
            next_case()
    return out


def family_references(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For each case: ``prepare_reference(policy)`` of the family's model wrapped that way, its logits
    beside the policy's (in eval mode), and the policy still training afterwards."""

    from tests.harness._matrix import key

    out: dict[str, Any] = {}
    for case in cases:
        out[key(case)] = _reference(case)
        next_case()
    return out


def _reference(case: dict[str, Any]) -> dict[str, Any]:
    """One case of ``family_references``."""
    import torch.distributed as dist

    wm = _wrapped(case, 1)
    inputs = family_inputs(wm.unwrap())
    want = _logits(wm, inputs)
    obs: dict[str, Any] = {"rank": dist.get_rank()}
    try:
        ref_model = None
        if case["family"] == "llama-fused" and case["spec"] != "plain":
            # Modules replaced after the model was built: a sharded policy's config cannot rebuild them, so the
            # reference is refused with the way out (ref_model), which then gives the policy's logits.
            try:
                wrapkit.prepare_reference(wm)
                obs["refused"] = "built"
            except wrapkit.ReferenceModelError as exc:
                obs["refused"] = "FusedSwiGLU" in str(exc) and "ref_model" in str(exc)
            ref_model = family_model(case["family"], 1)
        ref = wrapkit.prepare_reference(wm, ref_model)
        with torch.no_grad():
            got = ref(**{k: v.to(ref.device) for k, v in inputs.items()}).logits.detach().float().cpu()
        obs["diff"] = float((got - want).abs().max())
        obs["frozen"] = not any(p.requires_grad for p in ref.unwrap().parameters())
    except Exception as exc:  # reported per case, so that one family's failure shows beside the others
        import traceback

        obs["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    return obs


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_on_experts(family: str, seed: int, zeroed: bool = False) -> torch.nn.Module:
    """A PEFT model of ``family`` with LoRA on its fused experts (PEFT's ``target_parameters``, the recipe for
    gpt-oss and Qwen3-MoE), every LoRA matrix random from ``seed`` (or zero)."""
    from peft import LoraConfig, get_peft_model

    from wrapkit.cli._models import fill_adapters

    config = LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=EXPERT_TARGETS)
    return fill_adapters(get_peft_model(family_model(family, 1), config), seed, zeroed)


def expert_adapters(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For each case ``{"family", "spec", "precision"}``: every merged export of a model with LoRA on its
    experts against PEFT's ``merge_and_unload`` (and transformers' save of that), and the adapters alone
    against PEFT's own save, then loaded back into zeroed adapters."""

    import torch.distributed as dist

    from tests.harness._matrix import key

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with _shared_root() as root:
        for case in cases:
            out[key(case)] = _expert_case(case, root, rank)
            next_case()
    return out


def _expert_case(case: dict[str, Any], root: str, rank: int) -> dict[str, Any]:
    """One case of ``expert_adapters``."""
    import copy

    import torch.distributed as dist

    want: Any = lora_on_experts(case["family"], 7)
    merged = copy.deepcopy(want).merge_and_unload()
    oracle = {k: v.clone() for k, v in merged.state_dict().items()}
    owner = rank if case["spec"] == "plain" else 0
    base = os.path.join(root, "-".join(str(v) for v in case.values()))
    if rank == 0:
        merged.save_pretrained(base + "-merged-transformers")
        want.save_pretrained(base + "-adapters-peft")
    dist.barrier()
    wm = wrapkit.adapt(build(case["spec"], model=lora_on_experts(case["family"], 7)))
    obs: dict[str, Any] = {"rank": rank}
    obs["full_state_dict"] = _differences(wm.full_state_dict(rank0_only=False, merge_adapters=True), oracle)
    saved = _files(base + "-merged-transformers")
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=4096, merge_adapters=True)
                for n, t in b.named_tensors()}
    buffers = {n for n, _ in merged.named_buffers()}  # streams carry parameters only
    obs["stream"] = _differences(streamed, {n: t for n, t in saved.items() if n not in buffers})
    wm.save_pretrained(f"{base}-merged-wrapkit-{owner}", merge_adapters=True)
    obs["save_merged"] = _differences(_files(f"{base}-merged-wrapkit-{owner}"), saved)
    wm.save_pretrained(f"{base}-adapters-wrapkit-{owner}", adapters_only=True)
    obs["save_adapters"] = _differences(_files(f"{base}-adapters-wrapkit-{owner}"),
                                        _files(base + "-adapters-peft"))
    live = {k: v for k, v in wm.full_state_dict(rank0_only=False).items() if "lora_" in k}
    target = wrapkit.adapt(build(case["spec"], model=lora_on_experts(case["family"], 0, zeroed=True)))
    target.load(base + "-adapters-peft")
    obs["load_adapters"] = _differences(
        {k: v for k, v in target.full_state_dict(rank0_only=False).items() if "lora_" in k}, live)
    return obs
