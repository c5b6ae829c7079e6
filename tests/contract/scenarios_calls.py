"""Mismatched calls: ranks that enter different wrapkit operations (or one with different
arguments) are told so on every rank, promptly, with nothing changed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit._agree import CHECK_ENV
from wrapkit.cli._models import build

Op = Callable[[Any, Any, str], None]


def _gen(gather: str) -> Op:
    def run(wm: Any, ref: Any, tmp: str) -> None:
        with wm.generation(gather=gather):
            pass
    return run


def _gathered(modifier_rank: int | None) -> Op:
    def run(wm: Any, ref: Any, tmp: str) -> None:
        with wm.gathered(modifier_rank=modifier_rank) as m:
            with torch.no_grad():
                next(m.parameters()).add_(1.0)  # would change the weights if the call went through
    return run


# Each: what one rank calls. Neighbours in this list are paired (rank 0 calls one, rank 1 the next).
OPS: dict[str, Op] = {
    "save": lambda wm, ref, tmp: wm.save(os.path.join(tmp, "new.safetensors")),
    "generation": _gen("auto"),
    "save_pretrained": lambda wm, ref, tmp: wm.save_pretrained(os.path.join(tmp, "new-dir")),
    "gathered(modifier_rank=0)": _gathered(0),
    "load": lambda wm, ref, tmp: wm.load(os.path.join(tmp, "other.safetensors")),
    "copy_to": lambda wm, ref, tmp: wm.copy_to(ref, alpha=0.1),
    "named_full_parameters": lambda wm, ref, tmp: [None for _ in wm.named_full_parameters()],
    "place": lambda wm, ref, tmp: wm.place("cpu"),
    "full_state_dict": lambda wm, ref, tmp: wm.full_state_dict(),
    "load_full_state_dict": lambda wm, ref, tmp: wm.load_full_state_dict(
        wrapkit.read_checkpoint(os.path.join(tmp, "other.safetensors"))),
    "prepare_reference": lambda wm, ref, tmp: wrapkit.prepare_reference(wm),
    "ref.copy_to": lambda wm, ref, tmp: ref.copy_to(wm, alpha=0.5),
}
# The same operation with arguments that differ between the ranks.
ARGS: dict[str, tuple[Op, Op]] = {
    "modifier_rank": (_gathered(0), _gathered(1)),
    "alpha": (lambda wm, ref, tmp: wm.copy_to(ref, alpha=0.1), lambda wm, ref, tmp: wm.copy_to(ref, alpha=0.2)),
    "gather": (_gen("full"), _gen("layerwise")),
    "max_shard_size": (lambda wm, ref, tmp: wm.save_pretrained(os.path.join(tmp, "new-dir"), max_shard_size="1MB"),
                       lambda wm, ref, tmp: wm.save_pretrained(os.path.join(tmp, "new-dir"), max_shard_size="2MB")),
    "rank0_only": (lambda wm, ref, tmp: wm.full_state_dict(rank0_only=True),
                   lambda wm, ref, tmp: wm.full_state_dict(rank0_only=False)),
    "src_rank": (lambda wm, ref, tmp: wm.load(os.path.join(tmp, "other.safetensors"), src_rank=0),
                 lambda wm, ref, tmp: wm.load(os.path.join(tmp, "other.safetensors"))),
    # An argument invalid on one rank while the other calls another operation: still the mismatch.
    "device": (lambda wm, ref, tmp: wm.place("not-a-device"), lambda wm, ref, tmp: wm.copy_to(ref, alpha=0.1)),
}


def _state(wm: Any, ref: Any) -> dict[str, torch.Tensor]:
    out = {f"policy.{k}": v for k, v in wm.full_state_dict(rank0_only=False).items()}
    out.update({f"ref.{k}": v for k, v in ref.full_state_dict(rank0_only=False).items()})
    return out


def mismatched_calls(spec: str, tmp: str, precision: str = "fp32", topology: str = "flat") -> dict[str, Any]:
    """Every neighbouring pair of ``OPS`` (and every pair of ``ARGS``), rank 0 of the model's group
    calling one and the others the other: the error each rank got, how long it took, and whether
    anything changed (weights, files)."""
    wm = wrapkit.adapt(build(spec, precision=precision, topology=topology))
    # The rank in the model's group: every group (each sub-group, each HSDP replica) gets a mismatch.
    rank = wm.rank
    try:
        ref = wrapkit.prepare_reference(wm)
    except wrapkit.UnsupportedModelError:  # tensor parallel: the plan is not kept, so the user's own copy
        ref = wrapkit.prepare_reference(wm, build(spec, precision=precision, topology=topology))
    other = wrapkit.adapt(build(spec, seed=1, precision=precision, topology=topology))
    other.save(os.path.join(tmp, "other.safetensors"))
    # Every group has written its file (sub-groups write theirs side by side) before the listing.
    dist.barrier()
    before = _state(wm, ref)
    files = sorted(os.listdir(tmp))
    dist.barrier()  # every rank has listed them before any group starts its calls
    names = list(OPS)
    cases = [(f"{a} / {b}", OPS[a], OPS[b]) for a, b in zip(names, names[1:] + names[:1], strict=True)]
    cases += [(f"{arg} differs", *pair) for arg, pair in ARGS.items()]
    obs: dict[str, Any] = {}
    for label, mine, theirs in cases:
        start = time.perf_counter()
        try:
            (mine if rank == 0 else theirs)(wm, ref, tmp)
            error = "no error"
        except wrapkit.WrapkitError as exc:
            error = f"{type(exc).__name__}: {exc}"
        obs[label] = {"error": error, "seconds": time.perf_counter() - start}
    # With the check off, operations that agree on nothing else skip their entry: two that gather
    # the same tensors in the same order then pass each other unnoticed.
    os.environ[CHECK_ENV] = "0"
    try:
        if rank == 0:
            [None for _ in wm.named_full_parameters()]
        else:
            wm.full_state_dict(rank0_only=False)
        obs["unchecked"] = "no error"
    except wrapkit.WrapkitError as exc:
        obs["unchecked"] = f"{type(exc).__name__}: {exc}"
    finally:
        del os.environ[CHECK_ENV]
    dist.barrier()  # and every group is done with its calls before the files are listed again
    after = _state(wm, ref)
    obs["changed"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
    obs["files"] = sorted(os.listdir(tmp)) == files or (files, sorted(os.listdir(tmp)))
    # The group is still usable: a matched call goes through.
    with wm.generation() as m:
        m(input_ids=torch.tensor([[1, 2, 3]]))
    obs["after"] = "ok"
    return obs


def missing_internals(spec: str) -> str:
    """A backend version without a private field wrapkit reads (simulated by deleting it):
    adapt() refuses it with a typed error naming the version, instead of failing later."""
    from wrapkit._registry import as_adapter

    model = build(spec)
    if spec == "fsdp":
        flat = next(m._handle.flat_param for m in model.modules() if getattr(m, "_handle", None) is not None)
        del flat._shard_param_infos
    elif spec == "fsdp2":
        p = next(p for p in model.parameters() if hasattr(p, "_local_tensor"))
        del p._local_tensor
    else:
        del next(as_adapter(model).unwrap().parameters()).ds_status
    try:
        wrapkit.adapt(model)
    except wrapkit.UnsupportedModelError as exc:
        return f"UnsupportedModelError: {exc}"
    return "no error"
