"""Scenario functions run on every rank of the shared worker group (and in-process
for the single-process backends). Each builds its models itself and returns
plain, picklable observations that the test asserts on."""

from __future__ import annotations

import importlib
from typing import Any

import torch

TOKENS = torch.arange(16).reshape(2, 8) % 128


def _plain_reference(spec: str, wk_name: str = "wrapkit") -> torch.nn.Module:
    """The same model without any backend wrapper (PEFT kept: LoRA starts as identity)."""
    models = importlib.import_module(wk_name + ".cli._models")
    return models.build("peft" if "peft" in models.parse_stack(spec) else "plain")  # type: ignore[no-any-return]


def _cls(obj: object) -> str:
    """Class name, seeing through FSDP2's generated ``FSDP<Model>`` classes."""
    return next(c.__name__ for c in type(obj).__mro__ if not c.__module__.startswith("torch.distributed.fsdp"))


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def contract(spec: str, wk_name: str = "wrapkit", device: str = "cpu") -> dict[str, Any]:
    """Observe the read-only protocol on one stack; ``wk_name`` allows a vendored copy.

    ``device="cuda"`` builds on this rank's current GPU."""
    wk = importlib.import_module(wk_name)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    model = importlib.import_module(wk_name + ".cli._models").build(spec, device=device)
    wm = wk.adapt(model)
    ref = _plain_reference(spec, wk_name).to(device)
    obs: dict[str, Any] = {
        "backend": wm.backend,
        "stack": wm.stack,
        "module_is_model": wm.module is model,
        "adapt_again_is_same": wk.adapt(wm) is wm,
        "adapt_twice_equal": wk.adapt(model) == wm and wk.adapt(model).stack == wm.stack,
        "config_type": type(wm.config).__name__,
        "config_is_inner": wm.config is wm.unwrap(keep_peft=False).config,
        "is_encoder_decoder": wm.is_encoder_decoder,
        "unwrap": _cls(wm.unwrap()),
        "unwrap_no_peft": _cls(wm.unwrap(keep_peft=False)),
        "unwrap_keep_compile": _cls(wm.unwrap(keep_compile=True)),
        "device": str(wm.device),
        "zero_stage": wm.zero_stage,
        "is_sharded": wm.is_sharded,
        "world_size": wm.world_size,
        "rank": wm.rank,
        "num_parameters": wm.num_parameters(),
        "num_trainable": wm.num_parameters(trainable_only=True),
        "expected_parameters": sum(p.numel() for p in ref.parameters()),
        "expected_trainable": sum(p.numel() for p in ref.parameters() if p.requires_grad),
        "describe": wm.describe(),
        "resident": wm.resident_parameter_bytes(),
        "full_bytes": sum(p.numel() * p.element_size() for p in ref.parameters()),
        "is_protocol": isinstance(wm, wk.WrappedModel),
    }
    with torch.no_grad():
        got = _logits(wm(TOKENS.to(device)))
        want = _logits(ref(TOKENS.to(device)))
    obs["forward_max_diff"] = float((got - want).abs().max())
    if hasattr(model, "config") and wm.backend == "deepspeed":
        # Failure #1's silent half: the engine's own `.config` is DeepSpeed's dict.
        obs["engine_config_type"] = type(model.config).__name__
    return obs


def vendored_contract(path: str, spec: str, wk_name: str) -> dict[str, Any]:
    """The contract scenario against a vendored copy importable from ``path``."""
    import sys

    if path not in sys.path:
        sys.path.insert(0, path)
    return contract(spec, wk_name)


def destroyed_group_error() -> str:
    """Wrap with DDP on a fresh group, destroy that group, then adapt: must be refused."""
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    pg = dist.new_group(backend="gloo")
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_llama(), process_group=pg)
    dist.destroy_process_group(pg)
    try:
        wrapkit.adapt(model)
    except wrapkit.DistributedStateError as exc:
        return f"DistributedStateError: {exc}"
    return "no error"


def raw_engine_config() -> dict[str, Any]:
    """Failure #1 on DeepSpeed: the engine's .config is a dict, not the model's config."""
    import wrapkit
    from wrapkit.cli._models import build

    engine = build("zero2")
    wm = wrapkit.adapt(engine)
    return {
        "raw_type": type(engine.config).__name__,
        "raw_has_vocab": hasattr(engine.config, "vocab_size"),
        "wm_type": type(wm.config).__name__,
        "wm_vocab": wm.config.vocab_size,
    }


def quirks(spec: str) -> dict[str, Any]:
    """Backend details the contract does not cover."""
    import wrapkit
    from wrapkit.cli._models import build

    model = build(spec)
    wm = wrapkit.adapt(model)
    inner = wm.unwrap(keep_peft=False)
    return {
        "local_numel": sum(p.numel() for p in inner.parameters()),
        "global_numel": wm.num_parameters(),
        "unwrap_is_module": wm.unwrap() is model if wm.backend == "fsdp2" else None,
        "param_type": type(next(inner.parameters())).__name__,
    }


def fsdp1_variants() -> dict[str, Any]:
    """FSDP1 without use_orig_params, frozen parameters, and NO_SHARD."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    full = sum(p.numel() for p in tiny_llama().parameters())
    flat = FullyShardedDataParallel(tiny_llama(), device_id=torch.device("cpu"), use_orig_params=False)
    frozen_model = tiny_llama()
    frozen_model.model.embed_tokens.weight.requires_grad_(False)
    frozen = FullyShardedDataParallel(frozen_model, device_id=torch.device("cpu"), use_orig_params=True)
    noshard = FullyShardedDataParallel(
        tiny_llama(), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD
    )
    return {
        "full": full,
        "flat": wrapkit.adapt(flat).num_parameters(),
        "flat_sharded": wrapkit.adapt(flat).is_sharded,
        "frozen_trainable": wrapkit.adapt(frozen).num_parameters(trainable_only=True),
        "embed": frozen_model.config.vocab_size * frozen_model.config.hidden_size,
        "noshard_sharded": wrapkit.adapt(noshard).is_sharded,
        "noshard_count": wrapkit.adapt(noshard).num_parameters(),
    }


def tensor_parallel_refused() -> dict[str, str]:
    """A tensor-parallel Llama (``parallelize_module`` over a mesh's ``tp`` dimension), which ``adapt()``
    takes as the tp backend; on four ranks FSDP2 over ``mesh["dp"]`` of a (dp, tp) mesh on top of it,
    taken as fsdp2; and DDP over the dp group around a tensor-parallel model, which it must refuse,
    never call plain or ddp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    world = dist.get_world_size()
    tp_size = 2
    shape, names = ((world // tp_size, tp_size), ("dp", "tp")) if world > tp_size else ((tp_size,), ("tp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}

    def parallelized() -> Any:
        model = tiny_llama(0)
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        return model

    out: dict[str, str] = {}

    def attempt(key: str, obj: Any) -> None:
        try:
            wm = wrapkit.adapt(obj)
            out[key] = f"adapted as {wm.backend}, is_sharded={wm.is_sharded}"
        except wrapkit.UnsupportedModelError as exc:
            out[key] = f"UnsupportedModelError: {exc}"

    attempt("tp", parallelized())
    # A placement no reader here knows (Partial: pending sums), on a parameter the plan left alone.
    from torch.distributed.tensor import DTensor, Partial

    partial = parallelized()
    local = partial.model.norm.weight.detach().clone()
    partial.model.norm.weight = torch.nn.Parameter(DTensor.from_local(local, mesh["tp"], [Partial()]))
    attempt("tp+partial", partial)
    from peft import LoraConfig, get_peft_model

    def with_lora(model: Any) -> Any:
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    # PEFT sizes each rank's LoRA matrices to its slice, as plain tensors: refused, never read as whole.
    attempt("tp+peft", with_lora(parallelized()))
    if world > tp_size:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        model = parallelized()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        attempt("fsdp2+tp", model)
        lora = with_lora(parallelized())
        for layer in lora.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(lora, mesh=mesh["dp"])
        attempt("fsdp2+tp+peft", lora)
        attempt("ddp+tp", DistributedDataParallel(parallelized(), process_group=mesh["dp"].get_group(),
                                                  init_sync=False))
    return out


def topologies() -> dict[str, Any]:
    """What ``topology()`` says of each four-rank layout: group sizes, replica groups, and the mesh."""
    import torch.distributed as dist

    import wrapkit
    from wrapkit._registry import as_adapter
    from wrapkit.adapters import Role
    from wrapkit.cli._models import build

    out: dict[str, Any] = {}
    for spec, topology in [("fsdp", "hsdp"), ("fsdp", "hybrid-groups"), ("fsdp2", "hsdp"), ("fsdp2", "submesh"),
                           ("ddp", "subgroup"), ("zero3", "flat"), ("fsdp", "flat"), ("fsdp2", "flat"),
                           ("fsdp2", "tp"), ("fsdp2", "hsdp-tp")]:
        wm = as_adapter(wrapkit.adapt(build(spec, topology=topology)))
        described = wm.topology()
        group, replicas, mesh = described.group, described.replicas, described.mesh
        out[f"{spec}/{topology}"] = {
            "group": dist.get_world_size(group), "rank": dist.get_rank(group) if group is not None else dist.get_rank(),
            "replicas": [dist.get_world_size(g) for g in replicas],
            "mesh": None if mesh is None else tuple(mesh.mesh.shape),
            "parts_agree": (wm.process_group() is group and wm.replica_groups() == list(replicas)
                            and wm.mesh() is mesh),
            "world_size": wm.world_size,
            "roles": described.roles,
            "roles_typed": all(isinstance(r, Role) for r in described.roles),
            "data_parallel": (wm.data_parallel_rank, wm.data_parallel_size),
            "describe": wm.describe(),
        }
    # accelerate's layout for context parallelism: FSDP2 over dp_shard and cp flattened, the cp ranks
    # splitting the sequence of one batch (the forward under torch's context_parallel needs a GPU; the
    # layout does not).
    from torch.distributed.device_mesh import init_device_mesh

    from wrapkit.adapters.dtensor.sharding import fully_shard_per_block
    from wrapkit.cli._models import tiny_llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    cp = wrapkit.adapt(fully_shard_per_block(tiny_llama(0), mesh["dp_shard", "cp"]._flatten("dp_shard_cp")))
    want = tiny_llama(0).state_dict()
    out["fsdp2/cp"] = {"world_size": cp.world_size, "data_parallel": (cp.data_parallel_rank, cp.data_parallel_size),
                       "exact": all(torch.equal(v, want[k]) for k, v in cp.full_state_dict(rank0_only=False).items())}
    return out


# -- nothing kept alive ----------------------------------------------------------------------
_DROPPED: dict[str, Any] = {}  # spec -> weak references to what a scenario built and dropped


def use_and_drop(specs: list[str]) -> None:
    """Build each spec, run the operations a trainer runs on it, and drop everything but weak
    references to the model, its wrapper and its reference model."""
    import weakref

    import wrapkit
    from wrapkit.cli._models import build

    tokens = torch.arange(16).reshape(2, 8) % 128
    for spec in specs:
        module = build(spec, seed=1)
        wm = wrapkit.adapt(module)
        ref = wrapkit.prepare_reference(wm)
        wm(input_ids=tokens, labels=tokens).loss.backward()
        wm.full_state_dict()
        for _bucket in wm.stream_full_parameters():
            pass
        with wm.generation() as m:
            m.generate(tokens[:1], max_new_tokens=2, do_sample=False)
        with wm.gathered():
            pass
        if "peft" not in spec:  # a PEFT policy's reference is its adapter-disabled view, no weights of its own
            wm.copy_to(ref, alpha=0.5)
        _DROPPED[spec] = [weakref.ref(o) for o in (module, wm.unwrap(), wm, ref)]
        del module, wm, ref, m


def kept_alive() -> dict[str, list[bool]]:
    """Which of the dropped objects are still alive, after a collection."""
    import gc

    gc.collect()
    return {spec: [r() is not None for r in refs] for spec, refs in _DROPPED.items()}
