"""Tiny models and the wrapping recipes used by ``wrapkit doctor`` and the tests.

A stack is written outermost first, ``>``-separated: ``"ddp>compile>peft"`` means
``DDP(torch.compile(get_peft_model(llama)))``. Backend names: ``plain``, ``dp``,
``ddp``, ``fsdp`` (FSDP1, per-block, ``use_orig_params=True``), ``fsdp2``
(``fully_shard`` per block and root), ``zero0`` .. ``zero3`` (a DeepSpeed engine).
Layers: ``compile`` (``torch.compile`` with the eager backend: detection and the
forward path are tested, not inductor) and ``peft`` (LoRA on q/v projections).

``precision`` is each backend's usual mixed precision: fp32 weights computed in
bf16/fp16 (FSDP1 ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``, both reducing in
fp32), DeepSpeed's ``bf16``/``fp16`` section (half weights, fp32 masters in the
optimizer), and half weights for the unsharded ones. ``topology`` says how the ranks
are arranged (see ``TOPOLOGIES``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters._likeness import block_classes
from ..adapters.fsdp2 import fully_shard_per_block

__all__ = ["tiny_llama", "toy_model", "fill_adapters", "build", "parse_stack", "ds_config", "BACKENDS", "block_classes",
           "PRECISIONS", "TOPOLOGIES", "INDEPENDENT", "supports"]

BACKENDS = ("plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "tp")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How the ranks are arranged; all but "flat" stand in for two nodes of two devices (four ranks).
TOPOLOGIES = {
    "flat": "one group of every rank",
    "hsdp": "2-D mesh (replicate x shard): FSDP2 over the mesh, FSDP1 HYBRID_SHARD given it",
    "hybrid-groups": "FSDP1 HYBRID_SHARD given a (shard group, replicate group) tuple",
    "hybrid-zero2": "FSDP1 _HYBRID_SHARD_ZERO2 given the 2-D mesh",
    "submesh": "FSDP2 over the shard dimension of a 2-D mesh, the other dimension left alone",
    "subgroup": "DDP or DeepSpeed over half of the ranks (DeepSpeed told so by an mpu object)",
    "tp": "FSDP2 over the dp dimension of a (dp, tp) mesh, tensor parallel over the tp dimension",
    "hsdp-tp": "FSDP2 over (replicate, shard) of a (replicate, shard, tp) mesh, tensor parallel over tp: "
               "a (2, 1, 2) stand-in for the 3-D layout on four ranks",
}
# The layouts that train one model on each half of the ranks (no replicas between them).
INDEPENDENT = frozenset({"submesh", "subgroup"})
_DEEPSPEED = {"zero0", "zero1", "zero2", "zero3"}
_TOPOLOGY_BACKENDS = {"hsdp": {"fsdp", "fsdp2"}, "hybrid-groups": {"fsdp"}, "hybrid-zero2": {"fsdp"},
                      "submesh": {"fsdp2"}, "tp": {"fsdp2"}, "hsdp-tp": {"fsdp2"},
                      "subgroup": {"ddp"} | _DEEPSPEED}


def supports(backend: str, topology: str) -> str | None:
    """None when ``backend`` runs over ``topology``, else why not."""
    allowed = _TOPOLOGY_BACKENDS.get(topology)
    if topology not in TOPOLOGIES:
        return f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}"
    if allowed is not None and backend not in allowed:
        return f"{topology} is a layout of {' and '.join(sorted(allowed))}, not of {backend}"
    return None


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 32, vocab: int = 128) -> torch.nn.Module:
    """A transformers Llama built from a config (nothing downloaded), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class ToyModel(torch.nn.Module):
    """A config-less model, for when transformers is not installed."""

    _no_split_modules = ["_Block"]

    def __init__(self, dim: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def fill_adapters(model: torch.nn.Module, seed: int, zeroed: bool = False) -> torch.nn.Module:
    """Every LoRA matrix of ``model`` random from ``seed`` (distinct in each row, so that no rank's slice
    passes for another's), or zero; returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.zeros(p.shape) if zeroed else torch.randn(p.shape, generator=gen))
    return model


def toy_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ToyModel()


def parse_stack(spec: str) -> list[str]:
    return [part.strip() for part in spec.split(">") if part.strip()]


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # torch's AdamW: DeepSpeed's fused CPU Adam would need a C++ build.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    cfg.update(extra)
    return cfg


def _two_d_mesh(device: torch.device) -> Any:
    """(replicate, shard): each half of the ranks holds one full copy, sharded over its half."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if world < 4 or world % 2:
        raise ValueError(f"a 2-D mesh needs an even world size of at least 4, not {world}")
    return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))


def _halves() -> tuple[Any, Any]:
    """(this rank's half of the ranks, the group of the ranks at its position in the other half);
    the first is the data-parallel group of a "subgroup" layout, the second its model-parallel one."""
    mesh = _two_d_mesh(torch.device("cpu"))
    return mesh.get_group("shard"), mesh.get_group("replicate")


class _Mpu:
    """The model-parallel unit DeepSpeed takes (as Megatron provides it): data parallel over one
    half of the ranks, model parallel across the halves."""

    def __init__(self) -> None:
        self.dp, self.mp = _halves()

    def get_data_parallel_group(self) -> Any:
        return self.dp

    def get_data_parallel_world_size(self) -> int:
        return int(torch.distributed.get_world_size(self.dp))

    def get_data_parallel_rank(self) -> int:
        return int(torch.distributed.get_rank(self.dp))

    def get_model_parallel_group(self) -> Any:
        return self.mp

    def get_model_parallel_world_size(self) -> int:
        return int(torch.distributed.get_world_size(self.mp))

    def get_model_parallel_rank(self) -> int:
        return int(torch.distributed.get_rank(self.mp))


def _apply(layer: str, model: torch.nn.Module, device: torch.device, precision: str, topology: str) -> torch.nn.Module:
    half = PRECISIONS[precision] if precision != "fp32" else None
    if layer in ("plain", "dp", "ddp", "tp") and half is not None:
        model = model.to(half)
    if layer == "plain":
        return model.to(device)
    if layer == "compile":
        compiled: torch.nn.Module = torch.compile(model, backend="eager")  # type: ignore[assignment]
        return compiled
    if layer == "peft":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # type: ignore[no-any-return]
    if layer == "dp":
        return torch.nn.DataParallel(model.to(device))
    if layer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        group = _halves()[0] if topology == "subgroup" else None
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                       process_group=group)
    if layer == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks = block_classes(model)
        kwargs: dict[str, Any] = {}
        if half is not None:
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=half, reduce_dtype=torch.float32)
        if topology == "hsdp":
            kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=_two_d_mesh(device))
        elif topology == "hybrid-zero2":
            kwargs.update(sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2, device_mesh=_two_d_mesh(device))
        elif topology == "hybrid-groups":
            mesh = _two_d_mesh(device)
            kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                          process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
        return FullyShardedDataParallel(
            model,
            device_id=device,
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy(blocks) if blocks else None,
            **kwargs,
        )
    if layer == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if topology == "hsdp":
            mesh = _two_d_mesh(device)
        elif topology in ("tp", "hsdp-tp"):
            full = _dp_tp_mesh(device, hsdp=topology == "hsdp-tp")
            model = tensor_parallel(model.to(device), full["tp"])
            mesh = full["dp"] if topology == "tp" else full["replicate", "shard"]
        elif topology == "submesh":
            mesh = _two_d_mesh(device)["shard"]
        else:
            mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = {} if half is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)}
        return fully_shard_per_block(model.to(device), mesh, **mp)
    if layer == "tp":
        return tensor_parallel(model.to(device), _dp_tp_mesh(device)["tp"])
    if layer.startswith("zero") and layer[4:].isdigit():
        import deepspeed

        extra = {} if half is None else {precision: {"enabled": True}}
        mpu = _Mpu() if topology == "subgroup" else None
        if mpu is None:
            # DeepSpeed keeps the last engine's mpu process-wide (deepspeed.utils.groups.mpu) and
            # reads its groups from there: an engine after a sub-group one would inherit them.
            from deepspeed.utils import groups

            groups.mpu = None
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(int(layer[4:]), **extra), mpu=mpu)
        return engine  # type: ignore[no-any-return]
    raise ValueError(f"unknown stack layer {layer!r}; known: {', '.join(BACKENDS)}, compile, peft")


def _dp_tp_mesh(device: torch.device, hsdp: bool = False) -> Any:
    """A (dp, tp) mesh over every rank, two ranks along tp; with ``hsdp``, (replicate, shard, tp) with
    ``shard`` of one rank, the rest of the data-parallel ranks along ``replicate``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if world % 2:
        raise ValueError(f"the tp stack splits over two ranks, so it needs an even world size, not {world}")
    if hsdp:
        return init_device_mesh(device.type, (world // 2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))


def tensor_parallel(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """Tensor parallel over the 1-D ``mesh`` with torch's ``parallelize_module`` (the ``tp`` dimension of
    a (dp, tp) mesh: on more than two ranks each dp slice is a model of its own, unless FSDP2 shards
    over dp). A transformers decoder's attention and MLP projections are split column- then row-wise;
    any other model's linear layers column-wise, their outputs gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        plan: dict[str, Any] = {name: ColwiseParallel(output_layouts=Replicate())
                                for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        return parallelize_module(model, mesh, plan)
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    for layer in layers:
        parallelize_module(layer, mesh, plan)
    return model


def build(spec: str, *, model: torch.nn.Module | None = None, device: torch.device | str | None = None,
          seed: int = 0, precision: str = "fp32", topology: str = "flat") -> torch.nn.Module:
    """Wrap ``model`` (default: ``tiny_llama(seed)``) as ``spec`` says, innermost layer first."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    why = supports(parse_stack(spec)[0], topology)
    if why is not None:
        raise ValueError(why)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    model = tiny_llama(seed) if model is None else model
    for layer in reversed(parse_stack(spec)):
        model = _apply(layer, model, dev, precision, topology)
    return model
