"""Scenarios for ``gathered()``, ``generation()`` and ``named_full_parameters()``, run on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import build, parse_stack

TOKENS = torch.arange(16).reshape(2, 8) % 128
PROMPT = (torch.arange(12).reshape(2, 6) * 7) % 128


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _reference(spec: str) -> torch.nn.Module:
    """The same weights with no backend (LoRA kept: it starts as the identity)."""
    return build("peft" if "peft" in parse_stack(spec) else "plain")


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def full_parameters(spec: str) -> dict[str, Any]:
    """Names and values from named_full_parameters() and gathered(), against the unwrapped reference."""
    wm = wrapkit.adapt(build(spec))
    ref = _reference(spec)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    got = {n: t.clone() for n, t in wm.named_full_parameters()}
    obs: dict[str, Any] = {
        "names": sorted(got),
        "ref_state_dict_keys": sorted(k for k in ref.state_dict() if k in want),
        "unwrap_type": type(wm.unwrap()).__name__,
        "max_diff": max(float((got[n] - want[n]).abs().max()) for n in want if n in got),
        "shapes_ok": all(tuple(got[n].shape) == tuple(want[n].shape) for n in want if n in got),
    }
    with wm.gathered() as m:
        inside = {wrapkit.canonical_name(n): p.detach().clone() for n, p in m.named_parameters()}
        with torch.no_grad():
            out = _logits(m(TOKENS))
    obs["gathered_names"] = sorted(inside)
    obs["gathered_max_diff"] = max(float((inside[n] - want[n]).abs().max()) for n in inside)
    with torch.no_grad():
        obs["gathered_forward_diff"] = float((out - _logits(ref(TOKENS))).abs().max())
    # Nothing leaked: the wrapped model still runs its own way afterwards.
    with torch.no_grad():
        obs["forward_after_diff"] = float((_logits(wm(TOKENS)) - _logits(ref(TOKENS))).abs().max())
    return obs


def _value(wm: Any, name: str) -> tuple[float, float]:
    """First and last element: under sharding they live on different ranks."""
    # named_full_parameters is collective: consume it fully on every rank.
    out = (0.0, 0.0)
    for n, t in wm.named_full_parameters():
        if n == name:
            out = (float(t.flatten()[0]), float(t.flatten()[-1]))
    return out


def modifier_rank(spec: str, name: str) -> dict[str, Any]:
    """Writes with and without modifier_rank, and a failing body; the written value is read back."""
    wm = wrapkit.adapt(build(spec))
    rank, world = wm.rank, wm.world_size
    original = _value(wm, name)
    writer = world - 1  # rank 1 where there are two ranks: not the default rank 0

    def write(m: torch.nn.Module, value: float) -> None:
        with torch.no_grad():
            dict(m.named_parameters())[_local_name(m, name)].fill_(value)

    obs: dict[str, Any] = {"original": original, "world": world, "raised": False}
    # 1. modifier_rank=writer: only the writer writes; everyone must see it.
    with wm.gathered(modifier_rank=writer) as m:
        if rank == writer:
            write(m, 5.0)
    obs["after_modifier"] = _value(wm, name)
    # 2. no modifier_rank: every rank writes; discarded on sharded backends.
    with wm.gathered() as m:
        write(m, 7.0)
        obs["inside_none"] = float(dict(m.named_parameters())[_local_name(m, name)].detach().flatten()[-1])
    obs["after_none"] = _value(wm, name)
    # 3. The body fails on the writer only, after writing: nothing is kept anywhere.
    before = _value(wm, name)
    try:
        with wm.gathered(modifier_rank=writer) as m:
            write(m, 9.0)
            if rank == writer:
                raise KeyError("boom")
    except KeyError:
        obs["raised"] = True
    obs["after_failure"] = _value(wm, name)
    obs["before_failure"] = before
    # 4. A bad modifier_rank is refused on every rank before anything collective.
    try:
        with wm.gathered(modifier_rank=world):
            pass
    except wrapkit.DistributedStateError as exc:
        obs["bad_rank_error"] = type(exc).__name__
    return obs


def _local_name(m: torch.nn.Module, canonical: str) -> str:
    for n, _ in m.named_parameters():
        if wrapkit.canonical_name(n) == canonical:
            return n
    raise KeyError(canonical)


# -- generation --------------------------------------------------------------------
def _device(m: torch.nn.Module) -> torch.device:
    return next(m.parameters()).device


def _generate(m: Any) -> torch.Tensor:
    prompt = PROMPT.to(_device(m))
    out: torch.Tensor = m.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False,
        pad_token_id=0,
    )
    return out


def _state(wm: Any) -> dict[str, Any]:
    """Everything generation() promises to leave as it found it."""
    mods = list(wm.module.modules())
    params = list(wm.module.parameters())
    obs: dict[str, Any] = {
        "training": [m.training for m in mods],
        "requires_grad": [p.requires_grad for p in params],
        "param_ids": [id(p) for p in params],
        "param_types": [type(p).__name__ for p in params],
        "checkpointing": [m.__dict__.get("gradient_checkpointing") for m in mods],
        "hooks": [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in mods],
        "param_dicts": [id(m._parameters) for m in mods],
        "children": [[id(c) for c in m._modules.values()] for m in mods],
        "fsdp_managed": [m.__dict__.get("_is_fsdp_managed_module") for m in mods],
        "linear": id(torch.nn.functional.linear),  # ZeRO-3 replaces it process-wide
    }
    get_state = getattr(wm.module, "_get_fsdp_state", None)
    if get_state is not None:  # FSDP2: reshard settings of every group
        obs["reshard"] = [
            repr(getattr(getattr(m._get_fsdp_state(), "_fsdp_param_group", None), "post_forward_mesh_info", None))
            for m in mods if hasattr(m, "_get_fsdp_state")
        ]
    offload = getattr(getattr(wm.module, "optimizer", None), "parameter_offload", None)
    if offload is not None:  # ZeRO-3: hooks as DeepSpeed tracks them, coordinator, parameter status
        coord = offload.get_param_coordinator()
        obs["ds_hooks"] = [id(h) for h in offload.forward_hooks]
        obs["coordinator"] = (coord.is_complete_trace(), coord.is_invalid_trace(), coord.is_record_trace(),
                              len(getattr(coord, "_GatheredParameters__param_order", []) or []))
        obs["ds_status"] = [p.ds_status.name for p in params if hasattr(p, "ds_status")]
    return obs


def generation(spec: str, device: str = "cpu") -> dict[str, Any]:
    """Greedy tokens against the unsharded model; state unchanged after a normal and a failing exit."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    model = build(spec, device=dev)
    wm = wrapkit.adapt(model)
    # Gradient checkpointing on: it must be off inside and come back exactly.
    inner: Any = wm.unwrap(keep_peft=False)
    # transformers 5 renamed gradient_checkpointing_enable (older releases have only that name).
    (getattr(inner, "activation_checkpointing_enable", None) or inner.gradient_checkpointing_enable)()
    # transformers 4 checkpoints reentrantly by default: with PEFT's frozen embeddings nothing inside
    # a checkpointed block would need a gradient unless the inputs ask for one (as PEFT recommends).
    if "peft" in wm.stack:
        inner.enable_input_require_grads()
    # One training step first, so the backend's lazy state (FSDP init, ZeRO-3 trace) exists;
    # the reference then gets the trained weights, read back through named_full_parameters.
    _train_step(wm)
    ref = _reference(spec).to(dev).eval()
    trained = {n: t.clone() for n, t in wm.named_full_parameters()}
    missing, unexpected = ref.load_state_dict(trained, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    want = _generate(ref)
    before = _state(wm)
    # FSDP leaves this flag for transformers' generate(), which then syncs every rank at every step.
    managed = "_is_fsdp_managed_module"
    managed_outside = any(x.__dict__.get(managed) for x in wm.module.modules())
    with wm.generation() as m:
        inside = {
            "training": sum(x.training for x in m.modules()),
            "checkpointing": any(x.__dict__.get("gradient_checkpointing") for x in m.modules()),
            "fsdp_managed": any(x.__dict__.get(managed) for x in m.modules()),
        }
        got = _generate(m)
    after = _state(wm)
    try:
        with wm.generation() as m:
            _generate(m)
            if _rank() == 0:
                raise KeyError("boom")
    except KeyError:
        pass
    after_error = _state(wm)
    try:
        with wm.gathered(modifier_rank=0) as m:
            m.train(False)
            raise ValueError("boom")
    except ValueError:
        pass
    after_gathered_error = _state(wm)
    loss_after = _train_step(wm)
    return {
        "same_tokens": bool(torch.equal(got.cpu(), want.cpu())),
        "inside": inside,
        "managed_outside": managed_outside,
        "after_equal": after == before,
        "after_error_equal": after_error == before,
        "after_gathered_error_equal": after_gathered_error == before,
        "diff": [k for k in before if before[k] != after_error.get(k)],
        "loss_after": loss_after,
    }


def _train_step(wm: Any) -> float:
    """One forward/backward/step; asserts every module is in training mode at backward (failure #4)."""
    engine = wm.module if wm.backend == "deepspeed" else None
    tokens = TOKENS.to(wm.device)
    out = wm(tokens, labels=tokens)
    not_training = [type(m).__name__ for m in wm.module.modules() if not m.training]
    assert not not_training, f"backward with modules in eval mode: {sorted(set(not_training))}"
    if engine is not None:
        engine.backward(out.loss)
        engine.step()
    else:
        out.loss.backward()
        opt = wm.module.__dict__.setdefault("_test_opt", torch.optim.SGD(
            [p for p in wm.module.parameters() if p.requires_grad], lr=0.1))
        opt.step()
        opt.zero_grad()
    return float(out.loss.detach())


def alternate(spec: str, steps: int = 3) -> dict[str, Any]:
    """Failure #4: generation between training steps; losses equal those of a run without generation."""
    losses: dict[str, list[float]] = {}
    for with_generation in (False, True):
        wm = wrapkit.adapt(build(spec))
        wm.module.train()
        run: list[float] = []
        for _ in range(steps):
            if with_generation:
                with wm.generation() as m:
                    _generate(m)
            run.append(_train_step(wm))
        losses[str(with_generation)] = run
    return losses


def raw_eval_then_train(spec: str) -> list[str]:
    """The raw failure #4: eval() to generate, nothing switches back; the next backward runs in eval mode."""
    wm = wrapkit.adapt(build(spec))
    with torch.no_grad():
        if wm.backend == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel

            wm.module.eval()
            with FullyShardedDataParallel.summon_full_params(wm.module, recurse=False):
                _generate(wm.module.module)
        else:
            wm.module.eval()
            _generate(wm.unwrap())
    return sorted({type(m).__name__ for m in wm.module.modules() if not m.training})


def uneven(backend: str) -> dict[str, Any]:
    """Odd-sized parameters (rows not divisible by the world size, a 1-row weight): shards of unequal size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Linear(7, 1), torch.nn.Linear(1, 3), torch.nn.Embedding(3, 2)
    )
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    if backend == "fsdp":
        wrapped: torch.nn.Module = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    wm = wrapkit.adapt(wrapped)
    full = {n: t.clone() for n, t in wm.named_full_parameters()}
    with wm.gathered() as m:
        inside = {wrapkit.canonical_name(n): p.detach().clone() for n, p in m.named_parameters()}
    with wm.gathered(modifier_rank=wm.world_size - 1) as m:
        if wm.rank == wm.world_size - 1:
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) + i)
    written = {n: t.clone() for n, t in wm.named_full_parameters()}
    return {
        "full_equal": full.keys() == want.keys() and all(torch.equal(full[n], want[n]) for n in want),
        "gathered_equal": inside.keys() == want.keys() and all(torch.equal(inside[n], want[n]) for n in want),
        "written_equal": all(
            torch.equal(written[n], torch.arange(want[n].numel(), dtype=want[n].dtype).view(want[n].shape) + i)
            for i, n in enumerate(want)
        ),
    }


def generation_registered_generate(spec: str) -> dict[str, Any]:
    """FSDP2 with ``generate`` registered as a forward method (transformers' Trainer does this),
    generating before the first forward ever ran: the wrapper must not run inside generation()."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    wm = wrapkit.adapt(build(spec))
    register_fsdp_forward_method(wm.module, "generate")
    registered = wm.module.__dict__.get("generate")
    want = _generate(_reference(spec).eval())
    before = _state(wm)
    with wm.generation() as m:
        got = _generate(m)
    return {
        "registered": registered is not None,
        "same_tokens": bool(torch.equal(got, want)),
        "after_equal": _state(wm) == before,
        "wrapper_back": wm.module.__dict__.get("generate") is registered,
        "loss_after": _train_step(wm),
    }


def torch_ops(spec: str) -> dict[str, Any]:
    """Which ``F.linear`` each model's forward runs with, in a process holding a ZeRO-3 engine:
    ``spec``'s model inside generation() and gathered(), its reference from prepare_reference,
    and the engine's own forward."""
    import torch.nn.functional as F

    torch_linear = torch._C._nn.linear
    engine = wrapkit.adapt(build("zero3"))  # recent DeepSpeed: replaces F.linear for the process, for good
    if F.linear is torch_linear:
        # Older releases replace it in zero.Init only (which from_pretrained runs under ZeRO-3).
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                      "zero_optimization": {"stage": 3}}):
            torch.nn.Linear(4, 4)
    replaced = F.linear
    seen: list[bool] = []

    def record(mod: torch.nn.Module, args: Any) -> None:
        seen.append(F.linear is torch_linear)

    def probe(m: torch.nn.Module) -> Any:
        linear = next(x for x in m.modules() if isinstance(x, torch.nn.Linear))
        return linear.register_forward_pre_hook(record)

    wm = wrapkit.adapt(build(spec))
    obs: dict[str, Any] = {"replaced": replaced is not torch_linear,
                           "reported": sorted(wrapkit.base.torch_ops.replaced_ops())}
    with wm.generation() as m:
        handle = probe(m)
        _generate(m)
        handle.remove()
    obs["generation"], seen[:] = sorted(set(seen)), []
    obs["after_generation"] = F.linear is replaced
    with wm.gathered() as m:
        handle = probe(m)
        m(TOKENS)
        handle.remove()
    obs["gathered"], seen[:] = sorted(set(seen)), []
    ref = wrapkit.prepare_reference(wm.module)
    handle = probe(ref.unwrap())
    with torch.no_grad():
        ref.module(TOKENS)
    handle.remove()
    obs["reference"], seen[:] = sorted(set(seen)), []
    obs["after_reference"] = F.linear is replaced
    handle = probe(engine.unwrap())
    with torch.no_grad():
        engine.module(TOKENS)
    handle.remove()
    obs["engine"] = sorted(set(seen))
    obs["after_all"] = F.linear is replaced
    return obs
