"""Scenarios for place(), to_eval_frozen() and prepare_reference(), run on every rank of a
worker group (or in-process for the single-process backends). Each returns picklable
observations for the test to assert on."""

from __future__ import annotations

from typing import Any

import torch

import wrapkit
from wrapkit._adapt import AdapterDisabledView
from wrapkit._registry import as_adapter
from wrapkit.cli._models import build, ds_config, parse_stack, tiny_llama
from wrapkit.references.placement import move_verified

TOKENS = torch.arange(16).reshape(2, 8) % 128


def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


class _Trainer:
    """One optimisation step on any backend: DeepSpeed steps through its engine."""

    def __init__(self, wm: Any, lr: float = 1e-2) -> None:
        self.wm = wm
        self.opt = None if wm.backend == "deepspeed" else torch.optim.AdamW(
            [p for p in wm.module.parameters() if p.requires_grad], lr=lr)

    def step(self) -> float:
        tokens = TOKENS.to(self.wm.device)
        loss = self.wm(tokens, labels=tokens).loss
        if self.opt is None:
            self.wm.module.backward(loss)
            self.wm.module.step()
        else:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _snapshot(wm: Any) -> dict[str, torch.Tensor]:
    tensors = dict(as_adapter(wm).placement.tensors())
    # A ZeRO-3 parameter's data is compared through its partition: gathered copies come and go.
    return {name: t.detach().cpu().clone() for name, t in tensors.items() if f"{name} (partition)" not in tensors}


def place_round_trip(spec: str, device: str = "cpu") -> dict[str, Any]:
    """Train, offload, bring back, train on; compare with a twin that never moved."""
    dev = _device(device)
    wm, twin = wrapkit.adapt(build(spec, device=dev)), wrapkit.adapt(build(spec, device=dev))
    trainer, twin_trainer = _Trainer(wm), _Trainer(twin)
    losses = [trainer.step() for _ in range(2)]
    twin_losses = [twin_trainer.step() for _ in range(2)]
    before = _snapshot(wm)
    ptrs = {name: t.data_ptr() for name, t in as_adapter(wm).placement.tensors() if t.numel() > 0}
    if dev.type == "cpu":
        # One device only: force fresh storage, as an offload to another device would.
        move_verified(as_adapter(wm), torch.device("cpu"), copy=True)
    else:
        assert wm.place("cpu") is wm
    offloaded = sorted({str(t.device) for _, t in as_adapter(wm).placement.tensors()})
    changed = sum(1 for name, t in as_adapter(wm).placement.tensors()
                  if t.numel() > 0 and t.data_ptr() != ptrs.get(name))
    returned = wm.place() is wm
    after = _snapshot(wm)
    losses += [trainer.step() for _ in range(2)]
    twin_losses += [twin_trainer.step() for _ in range(2)]
    return {
        "offloaded_devices": offloaded,
        "storages_changed": changed,
        "storages": len(ptrs),
        "returned_self": returned,
        "home_devices": sorted({str(t.device) for _, t in as_adapter(wm).placement.tensors()}),
        "compute_device": str(wm.device),
        "bitwise_equal": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
        "losses": losses,
        "twin_losses": twin_losses,
    }


def placement_error() -> str:
    """A parameter that cannot be moved (meta data) must be named in a PlacementError."""
    wm = wrapkit.adapt(tiny_llama())
    mlp = wm.unwrap().model.layers[1].mlp
    mlp.down_proj.weight = torch.nn.Parameter(torch.empty_like(mlp.down_proj.weight, device="meta"))
    try:
        wm.place("cpu")
    except wrapkit.PlacementError as exc:
        return str(exc)
    return "no error"


def _frozen_facts(wm: Any) -> dict[str, Any]:
    # A view's tensors are the policy's.
    holder = wm._below.policy if isinstance(wm, AdapterDisabledView) else as_adapter(wm)
    return {
        "training_modules": sum(1 for m in wm.module.modules() if m.training),
        "trainable_parameters": wm.num_parameters(trainable_only=True),
        "devices": sorted({str(t.device) for _, t in holder.placement.tensors()}),
    }


def to_eval_frozen(spec: str) -> dict[str, Any]:
    wm = wrapkit.adapt(build(spec))
    plain = build("peft" if "peft" in parse_stack(spec) else "plain")
    frozen = wm.to_eval_frozen()
    again = frozen.to_eval_frozen()
    out = _logits(frozen(TOKENS.to(frozen.device)))  # no no_grad(): frozen means no graph either
    with torch.no_grad():
        want = _logits(plain(TOKENS))
    return {
        "backend": frozen.backend,
        "is_protocol": isinstance(frozen, wrapkit.WrappedModel),
        "is_sharded": frozen.is_sharded,
        "idempotent": again is frozen,
        "compute_device": str(frozen.device),
        "output_requires_grad": out.requires_grad,
        "forward_max_diff": float((out.detach().float().cpu() - want).abs().max()),
        **_frozen_facts(frozen),
    }


def _param_dtypes(ref: Any) -> list[str]:
    return sorted({str(p.dtype) for p in ref.unwrap().parameters()})


def prepare_reference(spec: str, with_ref: bool = False, eval_ref: bool = False, device: str = "cpu",
                      ref_on: str = "cpu") -> dict[str, Any]:
    """Build a reference for a policy, compare logits, train the policy a step, compare again."""
    dev = _device(device)
    policy = wrapkit.adapt(build(spec, device=dev))
    ref_in = None
    if with_ref:
        ref_in = build("peft" if "peft" in parse_stack(spec) else "plain", device=_device(ref_on))
        if eval_ref:
            ref_in.eval()  # the failure #3 set-up: an eval-mode model that skipped wrapping and placement
    tokens = TOKENS.to(policy.device)
    with torch.no_grad():
        policy(tokens)  # a policy that has run, as in a trainer (FSDP keeps its root gathered)
    ref = wrapkit.prepare_reference(policy.module, ref_in)
    with torch.no_grad():
        want = _logits(policy(tokens)).float()
        got = _logits(ref(tokens)).float()
    trainer = _Trainer(policy)
    trainer.step()
    with torch.no_grad():
        got_after = _logits(ref(tokens)).float()
        policy_after = _logits(policy(tokens)).float()
    return {
        "backend": ref.backend,
        "stack": ref.stack,
        "is_sharded": ref.is_sharded,
        "zero_stage": ref.zero_stage,
        "is_protocol": isinstance(ref, wrapkit.WrappedModel),
        "policy_device": str(policy.device),
        "ref_device": str(ref.device),
        "logits_device": str(got.device),
        "dtypes": _param_dtypes(ref),
        "num_parameters": ref.num_parameters(),
        "base_parameters": policy.num_parameters() - (policy.num_parameters(True) if "peft" in spec else 0),
        "max_diff": float((got - want).abs().max()),
        "unchanged_after_step": bool(torch.equal(got, got_after)),
        "policy_moved": float((policy_after - want).abs().max()),
        "policy_still_trains": sum(1 for p in policy.module.parameters() if p.requires_grad),
        **_frozen_facts(ref),
    }


def shared_refused(which: str) -> str:
    policy = wrapkit.adapt(build("ddp"))
    candidate = {"policy": policy.module, "inner": policy.unwrap(), "adapter": policy}[which]
    try:
        wrapkit.prepare_reference(policy.module, candidate)
    except wrapkit.ReferenceModelError as exc:
        return f"ReferenceModelError: {exc}"
    return "no error"


def failure2_zero2_peft() -> dict[str, Any]:
    """Failure #2: under ZeRO-2 with PEFT the trainer's reference was None and went to
    deepspeed.initialize; prepare_reference(policy, None) gives a working reference instead."""
    import deepspeed

    policy = build("zero2>peft")
    try:
        deepspeed.initialize(model=None, config=ds_config(2))
        raw = "no error"
    except Exception as exc:
        raw = f"{type(exc).__name__}: {exc}"
    ref = wrapkit.prepare_reference(policy, None)
    base = tiny_llama()
    with torch.no_grad():
        got = _logits(ref(TOKENS))
        want = _logits(base(TOKENS))
    _Trainer(wrapkit.adapt(policy)).step()
    with torch.no_grad():
        got_after = _logits(ref(TOKENS))
        policy_after = _logits(policy(TOKENS))
    return {
        "raw": raw,
        "type": type(ref).__name__,
        "max_diff": float((got - want).abs().max()),
        "unchanged_after_step": bool(torch.equal(got, got_after)),
        "policy_moved": float((policy_after - want).abs().max()),
        "policy_modes_restored": wrapkit.adapt(policy).module.training,
    }


def _resident(ref: Any) -> tuple[int, int]:
    """(bytes of parameters this rank holds now, bytes DeepSpeed keeps persistent)."""
    persistent = 0
    if ref.backend == "deepspeed":
        persistent = sum(p.ds_numel * p.element_size() for p in ref.unwrap().parameters()
                         if getattr(p, "ds_persist", False))
    return ref.resident_parameter_bytes(), persistent


def resident_bytes(spec: str, threshold_zero: bool = False) -> dict[str, Any]:
    """Per-rank parameter bytes a fresh reference keeps, at rest and after a forward."""
    policy = wrapkit.adapt(build(spec))
    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if threshold_zero else None
    ref = wrapkit.prepare_reference(policy.module, None, ds_config=overrides)
    full = sum(p.numel() * p.element_size() for p in tiny_llama().parameters())
    at_rest, persistent = _resident(ref)
    with torch.no_grad():
        ref(TOKENS)
    after_forward, _ = _resident(ref)
    return {"full": full, "at_rest": at_rest, "after_forward": after_forward, "persistent": persistent,
            "world": ref.world_size, "policy_resident": policy.resident_parameter_bytes()}


def zero_reference_config() -> dict[str, Any]:
    """The ZeRO-3 reference's DeepSpeed config is the policy's minus training-only blocks,
    with ``ds_config`` merged over it."""
    policy = build("zero3")
    overrides = {"zero_optimization": {"stage3_max_live_parameters": 12345}}
    ref = wrapkit.prepare_reference(policy, None, ds_config=overrides)
    cfg = ref.module.config
    return {
        "policy_keys": sorted(policy.config),
        "ref_keys": sorted(cfg),
        "zero": cfg["zero_optimization"],
        "optimizer": type(ref.module.optimizer).__name__,
    }


def bf16_zero2_reference() -> dict[str, Any]:
    """A ZeRO-2 engine computing in bf16 gets a bf16 reference, unsharded, on its device."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=ds_config(2, bf16={"enabled": True}))
    ref = wrapkit.prepare_reference(engine, None)
    with torch.no_grad():
        want = _logits(engine(TOKENS)).float()
        got = _logits(ref(TOKENS)).float()
    return {"backend": ref.backend, "dtypes": _param_dtypes(ref), "max_diff": float((got - want).abs().max())}


def ds_config_for_ddp() -> str:
    policy = build("ddp")
    try:
        wrapkit.prepare_reference(policy, None, ds_config={"zero_optimization": {"stage": 3}})
    except wrapkit.ReferenceModelError as exc:
        return f"ReferenceModelError: {exc}"
    return "no error"


def loaded_bf16_reference(spec: str, tmp: str) -> dict[str, Any]:
    """A bf16 policy as transformers loads one (``from_pretrained(..., dtype=bfloat16)``: weights in bf16,
    rotary tables in float32), wrapped in ``spec``; the frozen copy ``prepare_reference`` builds keeps
    each buffer's dtype and gives the policy's logits exactly."""
    import os

    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from wrapkit.cli._models import build, tiny_llama

    directory = os.path.join(tmp, "bf16-checkpoint")
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        tiny_llama(0).save_pretrained(directory)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    # Each backend's bf16 set-up (DeepSpeed's bf16 section, FSDP's bf16 mixed precision).
    wm = wrapkit.adapt(build(spec, model=model, precision="bf16"))
    ref = wrapkit.prepare_reference(wm)
    tokens = torch.arange(16).reshape(2, 8) % 128
    wm.module.eval()
    with torch.no_grad():
        diff = float((_logits(ref(tokens)) - _logits(wm(tokens))).abs().max())
    buffers = {k: str(b.dtype) for k, b in ref.unwrap().named_buffers()}
    return {"diff": diff, "buffers": buffers, "dtypes": (str(next(wm.unwrap().parameters()).dtype),
                                                       str(next(ref.unwrap().parameters()).dtype)),
            "policy_buffers": {k: str(b.dtype) for k, b in wm.unwrap().named_buffers()}}


class _TitanBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(dim)
        self.feed_forward = torch.nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.feed_forward(self.attention_norm(h))


class TitanLike(torch.nn.Module):
    """torchtitan's layout: ``tok_embeddings``, blocks in a ``ModuleDict`` keyed "0", "1", ..., ``norm`` and
    ``output``; no ``_no_split_modules`` and no transformers config."""

    def __init__(self, vocab: int = 128, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleDict({str(i): _TitanBlock(dim) for i in range(layers)})
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _units(module: torch.nn.Module, backend: str) -> list[list[str]]:
    """A sharded module's units by canonical path, grouped as sharded together (the root left out)."""
    from wrapkit._names import canonical_name

    if backend == "fsdp2":
        from wrapkit.adapters.dtensor.sharding import unit_groups

        return sorted(sorted(g) for g in unit_groups(module))
    from torch.distributed.fsdp import FullyShardedDataParallel

    return sorted([canonical_name(p)] for p, m in module.named_modules()
                  if p and isinstance(m, FullyShardedDataParallel))


def reference_sharded_like_policy(backend: str) -> dict[str, Any]:
    """A torchtitan-style model sharded as torchtitan shards it (the embedding, each block, the norm and the
    head together, the root; FSDP1: the embedding and each block): the reference's units against the policy's,
    and their outputs."""
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    model = TitanLike()
    fresh = copy.deepcopy(model)
    if backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.tok_embeddings, mesh=mesh)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard([model.norm, model.output], mesh=mesh)
        fully_shard(model, mesh=mesh)
        policy_module: torch.nn.Module = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy_module = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"),
                                                 auto_wrap_policy=ModuleWrapPolicy({_TitanBlock, torch.nn.Embedding}))
    wm = wrapkit.adapt(policy_module)
    ref = wrapkit.prepare_reference(wm, fresh)
    with torch.no_grad():
        ours, theirs = wm(TOKENS), ref(TOKENS)
    return {"policy": _units(policy_module, backend), "reference": _units(ref.module, backend),
            "same": bool(torch.equal(ours, theirs))}
