"""Scenarios for weights in and out (full_state_dict, load, save/load, copy_to).

They run on every rank of the shared worker group (or in the test process for the
single-process cases) and return plain, picklable observations.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import wrapkit
from wrapkit._registry import as_adapter
from wrapkit.cli._models import build, tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128
MATRIX = ("plain", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")
# What ``matrix`` observes of each backend's own export (beside the pairs).
EXPORT_FACTS = ("fsd_equal", "rank0_only_empty", "rank_of", "file_equal", "plain_loads_file", "forward")


def _plain_sd(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_llama(seed).state_dict().items()}


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _dev(device: str) -> str:
    """``"cuda"`` means this rank's current GPU (the worker set it)."""
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device


def _logits(wm: Any) -> torch.Tensor:
    with torch.no_grad():
        out = wm(TOKENS.to(wm.device))
    return (out.logits if hasattr(out, "logits") else out).detach().float().cpu()


def _flags(wm: Any) -> tuple[list[bool], list[bool]]:
    inner = wm.unwrap(keep_peft=False)
    return [m.training for m in inner.modules()], [p.requires_grad for p in inner.parameters()]


# -- the save x load matrix --------------------------------------------------------------
def matrix(tmpdir: str, device: str = "cpu", pairs: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Save on each backend, load on each: ``(source, target)`` pairs (all 49 of MATRIX by default)
    compared bitwise.

    Backend ``b`` is built once from seed ``MATRIX.index(b) + 1``, so every file holds different
    weights; a target loads its sources starting with the next backend's and its own file last,
    so every load changes every weight, and the forward after its own file checks the shards that
    forward really uses.
    """
    import torch.distributed as dist

    pairs = [(s, t) for t in MATRIX for s in MATRIX] if pairs is None else pairs
    backends = [b for b in MATRIX if any(b in pair for pair in pairs)]
    dev = _dev(device)
    seeds = {b: MATRIX.index(b) + 1 for b in backends}
    wms = {b: wrapkit.adapt(build(b, seed=seeds[b], device=dev)) for b in backends}
    truth = {b: _plain_sd(seeds[b]) for b in backends}
    obs: dict[str, Any] = {"rank": dist.get_rank(), "fsd_equal": {}, "rank0_only_empty": {}, "pairs": {},
                           "forward": {}, "file_equal": {}, "plain_loads_file": {}, "rank_of": {}}
    for b, wm in wms.items():
        obs["fsd_equal"][b] = _bitwise(wm.full_state_dict(rank0_only=False), truth[b])
        sd0 = wm.full_state_dict()
        # A plain model is not distributed: each process holds all of it and is its rank 0.
        obs["rank0_only_empty"][b] = _bitwise(sd0, truth[b]) if wm.rank == 0 else sd0 == {}
        obs["rank_of"][b] = wm.rank
        wm.save(os.path.join(tmpdir, f"{b}.safetensors"))
    from safetensors.torch import load_file

    for b in backends:
        path = os.path.join(tmpdir, f"{b}.safetensors")
        on_disk = load_file(path)
        obs["file_equal"][b] = _bitwise(on_disk, truth[b])
        plain = tiny_llama(99)
        plain.load_state_dict(on_disk, strict=True)
        obs["plain_loads_file"][b] = _bitwise(dict(plain.state_dict()), truth[b])
    for t in backends:
        rotation = MATRIX[MATRIX.index(t) + 1:] + MATRIX[: MATRIX.index(t) + 1]
        for s in (s for s in rotation if (s, t) in pairs):
            wms[t].load(os.path.join(tmpdir, f"{s}.safetensors"))
            obs["pairs"][f"{s}->{t}"] = _bitwise(wms[t].full_state_dict(rank0_only=False), truth[s])
        if (t, t) in pairs:
            want = tiny_llama(seeds[t]).to(dev)
            obs["forward"][t] = float((_logits(wms[t]) - _logits(wrapkit.adapt(want))).abs().max())
    return obs


def matrix_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """``matrix`` for the selected cases ``{"spec": target, "load": source}``, one observation each:
    the pair's result, and for a backend loading its own file the export facts of that backend."""
    import shutil
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        obs = matrix(str(box[0]), pairs=[(c["load"], c["spec"]) for c in cases])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(box[0]), ignore_errors=True)
    out = {}
    for c in cases:
        t, s = c["spec"], c["load"]
        one = {"rank": obs["rank"], "pair": obs["pairs"][f"{s}->{t}"]}
        if s == t:
            one.update({k: obs[k][t] for k in EXPORT_FACTS})
        out[repr(sorted(c.items()))] = one
    return out


# -- copy_to / EMA -----------------------------------------------------------------------
def copy_pairs(pairs: list[tuple[str, str]], alpha: float, device: str = "cpu") -> dict[str, Any]:
    """For each (source, target): EMA with ``alpha``, then an exact copy, checked on every rank."""
    dev = _dev(device)
    out: dict[str, Any] = {}
    def built(spec: str, seed: int) -> Any:
        # "fsdp2+tp": FSDP2 over the dp dimension of a (dp, tp) mesh beside tensor parallelism over tp.
        layout = {"topology": "tp"} if spec == "fsdp2+tp" else {}
        return wrapkit.adapt(build(spec.split("+")[0], seed=seed, device=dev, **layout))

    for s, t in pairs:
        src = built(s, 1)
        dst = built(t, 2)
        if t in ("plain", "fsdp2"):
            # A frozen target (a reference model) must stay frozen.
            dst.unwrap(keep_peft=False).requires_grad_(False)
        flags = _flags(dst)
        a, b = _plain_sd(1), _plain_sd(2)
        from wrapkit.sync.copy_to import _shard_pairs

        shard_to_shard = _shard_pairs(as_adapter(src), as_adapter(dst)) is not None
        src.copy_to(dst, alpha=alpha)
        ema = dst.full_state_dict(rank0_only=False)
        want = {k: (b[k].float() * (1.0 - alpha) + a[k].float() * alpha).to(b[k].dtype) for k in a}
        plain_ema = tiny_llama(0)
        plain_ema.load_state_dict(want)
        plain_ema.to(dev)
        obs = {
            "ema_max_diff": _max_diff(ema, want),
            "ema_changed": _max_diff(ema, b) > 1e-3,
            "ema_forward": float((_logits(dst) - _logits(wrapkit.adapt(plain_ema))).abs().max()),
            "source_unchanged": _bitwise(src.full_state_dict(rank0_only=False), a),
        }
        src.copy_to(dst)
        obs["copy_bitwise"] = _bitwise(dst.full_state_dict(rank0_only=False), a)
        obs["copy_forward"] = float((_logits(dst) - _logits(wrapkit.adapt(tiny_llama(1).to(dev)))).abs().max())
        obs["flags_kept"] = _flags(dst) == flags
        obs["frozen"] = not any(_flags(dst)[1]) if t in ("plain", "fsdp2") else None
        obs["shard_to_shard"] = shard_to_shard
        out[f"{s}->{t}"] = obs
    return out


def step_after_write(stage: str) -> dict[str, Any]:
    """Load into a DeepSpeed engine, then take an optimizer step with zero gradients.

    AdamW with zero gradients only applies weight decay (a 1e-5 relative change), so the
    weights after the step must be the loaded ones, not the ones the engine started from:
    ZeRO keeps a private fp32 master copy that a load must refresh.
    """
    wm = wrapkit.adapt(build(stage, seed=2))
    engine = wm.module
    wrapkit.adapt(build("plain", seed=1)).copy_to(wm)
    loss = engine(TOKENS, labels=TOKENS).loss * 0.0
    engine.backward(loss)
    engine.step()
    got = wm.full_state_dict(rank0_only=False)
    want = _plain_sd(1)
    return {"max_rel_diff": max(float(((got[k] - want[k]).abs() / (want[k].abs() + 1e-3)).max()) for k in want)}


# -- strict loading and errors ---------------------------------------------------------------
def strict_errors(spec: str, tmpdir: str) -> dict[str, Any]:
    """Bad state dicts and bad files: typed errors on every rank, the model unchanged."""
    import torch.distributed as dist

    wm = wrapkit.adapt(build(spec, seed=3))
    before = wm.full_state_dict(rank0_only=False)
    flags = _flags(wm)
    keys = list(before)
    # Every other value changed: if anything were written before the error, we would see it.
    bad = {k: v + 1.0 for k, v in before.items()}
    del bad[keys[0]]
    bad["model.not_a_layer.weight"] = torch.zeros(3)
    bad[keys[1]] = torch.zeros(7, 7)
    obs: dict[str, Any] = {}

    def attempt(fn: Any) -> str:
        try:
            fn()
        except wrapkit.StateDictError as exc:
            return f"StateDictError: {exc}"
        except Exception as exc:  # a wrong type is a failure the test reports
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    obs["strict"] = attempt(lambda: wm.load_full_state_dict(bad))
    obs["unchanged_strict"] = _bitwise(wm.full_state_dict(rank0_only=False), before)
    # A problem on rank 1 only must still raise on both ranks, before any collective write.
    # (A plain model is not distributed: each process's copy is its own business.)
    if as_adapter(wm).distributed:
        one_rank = {k: v + 1.0 for k, v in before.items()}
        if dist.get_rank() == 1:
            del one_rank[keys[-1]]
        obs["one_rank"] = attempt(lambda: wm.load_full_state_dict(one_rank))
        obs["unchanged_one_rank"] = _bitwise(wm.full_state_dict(rank0_only=False), before)
    # strict=False ignores missing and unexpected keys but never a wrong shape.
    lenient = {k: v + 1.0 for k, v in before.items() if k != keys[0]}
    lenient["extra.weight"] = torch.zeros(2)
    wm.load_full_state_dict(lenient, strict=False)
    after = wm.full_state_dict(rank0_only=False)
    obs["lenient_loaded"] = all(torch.equal(after[k], lenient[k]) for k in lenient if k in after)
    obs["lenient_kept_missing"] = torch.equal(after[keys[0]], before[keys[0]])
    wm.load_full_state_dict(before)
    # Files: truncated, garbage, missing.
    good = os.path.join(tmpdir, f"{spec}-good.safetensors")
    wm.save(good)
    data = open(good, "rb").read()
    if dist.get_rank() == 0:
        with open(os.path.join(tmpdir, f"{spec}-trunc.safetensors"), "wb") as fh:
            fh.write(data[: len(data) // 2])
        with open(os.path.join(tmpdir, f"{spec}-garbage.safetensors"), "wb") as fh:
            fh.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[100:200])
    dist.barrier()
    for kind in ("trunc", "garbage", "missing"):
        obs[f"file_{kind}"] = attempt(lambda kind=kind: wm.load(os.path.join(tmpdir, f"{spec}-{kind}.safetensors")))
    obs["unchanged_files"] = _bitwise(wm.full_state_dict(rank0_only=False), before)
    obs["flags_kept"] = _flags(wm) == flags
    # Copying between models whose names or shapes differ.
    other = wrapkit.adapt(build(spec, model=tiny_llama(4, layers=3)))
    other_before = other.full_state_dict(rank0_only=False)
    obs["copy_mismatch"] = attempt(lambda: wm.copy_to(other))
    obs["copy_target_unchanged"] = _bitwise(other.full_state_dict(rank0_only=False), other_before)
    obs["bad_alpha"] = attempt(lambda: wm.copy_to(other, alpha=1.5))
    obs["save_bad_dir"] = attempt(lambda: wm.save(os.path.join(tmpdir, "no", "such", "dir.safetensors")))
    return obs


# -- PEFT -------------------------------------------------------------------------------------
def _peft_with_trained_lora(seed: int = 0) -> torch.nn.Module:
    """A LoRA model whose B matrices are non-zero (fresh LoRA is the identity: nothing to merge)."""
    model = build("peft", seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def peft_reference() -> dict[str, Any]:
    """What the plain PEFT model holds and what PEFT's own merge_and_unload gives."""
    import copy

    model = _peft_with_trained_lora()
    held = {k: v.clone() for k, v in model.state_dict().items()}
    merged = copy.deepcopy(model).merge_and_unload()
    return {"held": held, "merged": {k: v.clone() for k, v in merged.state_dict().items()}}


def peft_export(spec: str) -> dict[str, Any]:
    """Default and merged export of a PEFT model wrapped as ``spec``; the live model must not change."""
    model = _peft_with_trained_lora()
    if spec != "peft":
        # Wrap the already-trained PEFT model in the backend (spec is "<backend>>peft").
        model = build(spec.split(">")[0], model=model)
    wm = wrapkit.adapt(model)
    before = wm.full_state_dict(rank0_only=False)
    out_before = _logits(wm)
    merged = wm.full_state_dict(rank0_only=False, merge_adapters=True)
    return {
        "held": before,
        "merged": merged,
        "unchanged": _bitwise(wm.full_state_dict(rank0_only=False), before),
        "forward_unchanged": torch.equal(_logits(wm), out_before),
        "any_merged_flag": any(bool(getattr(m, "merged", False)) for m in wm.unwrap().modules()),
    }


# -- the kill test's saving process ------------------------------------------------------------
def save_big(path: str, numel: int) -> None:
    """Save a plain model holding ``numel`` floats (run in a process the test kills)."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.full((numel,), 2.0))
    wrapkit.adapt(model).save(path)


# -- wrapping variants ---------------------------------------------------------------------
def _tied_llama(seed: int) -> torch.nn.Module:
    model = tiny_llama(seed)
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    return model


def variants() -> dict[str, Any]:
    """FSDP1 without use_orig_params (only FlatParameters registered) and tied embeddings."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from wrapkit.cli._models import block_classes

    out: dict[str, Any] = {}
    model = tiny_llama(1)
    flat = wrapkit.adapt(FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=False,
                                                  auto_wrap_policy=ModuleWrapPolicy(block_classes(model))))
    out["flat_fsd"] = _bitwise(flat.full_state_dict(rank0_only=False), _plain_sd(1))
    flat.load_full_state_dict(_plain_sd(2))
    out["flat_load"] = _bitwise(flat.full_state_dict(rank0_only=False), _plain_sd(2))
    wrapkit.adapt(build("zero3", seed=3)).copy_to(flat)
    out["flat_copy"] = _bitwise(flat.full_state_dict(rank0_only=False), _plain_sd(3))
    tied_truth = {k: v.clone() for k, v in _tied_llama(4).state_dict().items()}
    for spec in ("zero3", "fsdp2", "fsdp"):
        wm = wrapkit.adapt(build(spec, model=_tied_llama(5)))
        wm.load_full_state_dict(tied_truth)
        got = wm.full_state_dict(rank0_only=False)
        out[f"tied_{spec}"] = _bitwise(got, tied_truth)
        out[f"tied_{spec}_forward"] = float((_logits(wm) - _logits(wrapkit.adapt(_tied_llama(4)))).abs().max())
    return out


def sync_after_forwards(spec: str) -> dict[str, Any]:
    """copy_to into a reference that has already run forwards: under ZeRO-3 small parameters then
    stay gathered between forwards, and the sync must reach those full copies too."""
    from wrapkit.sync.copy_to import _shard_pairs

    policy = wrapkit.adapt(build(spec, seed=1))
    ref = wrapkit.prepare_reference(policy, tiny_llama(2))
    for _ in range(3):
        _logits(ref)
    fast = _shard_pairs(as_adapter(policy), as_adapter(ref)) is not None
    policy.copy_to(ref)
    exact = float((_logits(ref) - _logits(policy)).abs().max())
    for _ in range(2):
        _logits(ref)
    policy.copy_to(ref, alpha=0.5)  # policy == ref already: EMA must leave them equal
    after_ema = float((_logits(ref) - _logits(policy)).abs().max())
    # A training model as the target (its root may keep parameters unsharded after a forward).
    trained = wrapkit.adapt(build(spec, seed=2))
    for _ in range(3):
        _logits(trained)
    policy.copy_to(trained)
    into_trained = float((_logits(trained) - _logits(policy)).abs().max())
    return {"fast": fast, "exact": exact, "after_ema": after_ema, "into_trained": into_trained}


def cached_sync(backend: str) -> dict[str, Any]:
    """A same-layout ``copy_to`` after the first: how many collectives it makes, checked and not
    (``WRAPKIT_CHECK_CALLS=0``), and whether it still writes the live shards after either model's
    shards moved to fresh storage, or the target was replaced by another model."""
    import torch.distributed as dist

    from wrapkit.references.placement import move_verified

    src = wrapkit.adapt(build(backend, seed=1))
    dst = wrapkit.adapt(build(backend, seed=2))
    # Collectives counted on the default group and the models' own (a ZeRO-3 engine makes its own).
    groups = {id(g): g for g in (dist.distributed_c10d._get_default_group(), as_adapter(src).process_group(),
                                 as_adapter(dst).process_group()) if g is not None}

    def collectives(fn: Any) -> int:
        before = sum(g._get_sequence_number_for_group() for g in groups.values())
        fn()
        return int(sum(g._get_sequence_number_for_group() for g in groups.values()) - before)

    a = _plain_sd(1)
    obs: dict[str, Any] = {"first": collectives(lambda: src.copy_to(dst, alpha=0.5))}
    obs["checked"] = collectives(lambda: src.copy_to(dst, alpha=0.5))
    os.environ["WRAPKIT_CHECK_CALLS"] = "0"
    try:
        obs["unchecked"] = collectives(lambda: src.copy_to(dst))
        obs["unchecked_exact"] = _bitwise(dst.full_state_dict(rank0_only=False), a)
        # Fresh storage on both sides (what an offload and back does): the pairing is read again.
        for wm in (src, dst):
            move_verified(as_adapter(wm), torch.device("cpu"), copy=True)
        with src.gathered(modifier_rank=0) as m, torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        want = src.full_state_dict(rank0_only=False)
        obs["after_move"] = collectives(lambda: src.copy_to(dst))
        obs["after_move_exact"] = _bitwise(dst.full_state_dict(rank0_only=False), want)
        other = wrapkit.adapt(build(backend, seed=3))
        src.copy_to(other)
        obs["new_target_exact"] = _bitwise(other.full_state_dict(rank0_only=False), want)
    finally:
        del os.environ["WRAPKIT_CHECK_CALLS"]
    return obs


def zero3_writes_after_slow_gathers(rounds: int = 4) -> dict[str, Any]:
    """Loads into a ZeRO-3 model whose first parameter is large and whose last ones are tiny.

    DeepSpeed's blocking gather of several parameters starts one all-gather each; before 0.19 it
    waited for the last only, and on gloo each runs on its own thread. With the large one first,
    its gather is still filling the parameter when the tiny last one has finished: a write made
    then is overwritten by the gather's late values unless wrapkit waits for all of them."""
    big = torch.nn.Sequential(torch.nn.Linear(4096, 2048), torch.nn.LayerNorm(8))
    wm = wrapkit.adapt(build("zero3", model=big))
    lost: list[list[str]] = []
    for i in range(rounds):
        want = {k: torch.full_like(v, float(i + 2)) for k, v in wm.full_state_dict(rank0_only=False).items()}
        wm.load_full_state_dict(want)
        got = wm.full_state_dict(rank0_only=False)
        lost.append([k for k in want if not torch.equal(got[k], want[k])])
    return {"lost": lost}


def escaping_index() -> dict[str, Any]:
    """An FSDP2 model's save_pretrained directory whose index names a file outside it: each rank's load,
    every rank reading and with rank 0 reading for all, must refuse it, changing nothing."""
    import json
    import shutil
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = str(box[0])
    wm = wrapkit.adapt(build("fsdp2", seed=1))
    directory = os.path.join(root, "ckpt")
    wm.save_pretrained(directory, max_shard_size="16KB")
    if dist.get_rank() == 0:
        index_path = os.path.join(directory, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        file = sorted(set(index["weight_map"].values()))[0]
        shutil.move(os.path.join(directory, file), os.path.join(root, file))
        index["weight_map"] = {k: ("../" + v if v == file else v) for k, v in index["weight_map"].items()}
        with open(index_path, "w") as f:
            json.dump(index, f)
    dist.barrier()
    target = wrapkit.adapt(build("fsdp2", seed=2))
    before = target.full_state_dict(rank0_only=False)
    errors = []
    for src_rank in (None, 0):
        try:
            target.load(directory, src_rank=src_rank)
            errors.append("loaded")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    after = target.full_state_dict(rank0_only=False)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"errors": errors, "unchanged": _bitwise(before, after)}
