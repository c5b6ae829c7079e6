"""How ``wrapkit doctor``, the benchmarks and the tests build a model of each backend: every adapter
class carries its own ``Recipe`` (a backend with none is detected and served, never built here), and
the stack builder (``cli/_models.py``) reads them from the registry. The layouts of ranks a recipe may
be asked for (``TOPOLOGIES``) and the meshes and groups that make them are shared here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Recipe", "Setting", "TOPOLOGIES", "two_d_mesh", "halves", "Mpu", "dp_tp_mesh", "tensor_parallel",
           "ds_config", "whole"]

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


class Setting(NamedTuple):
    """Where and how a recipe builds: the ``device``, the 16-bit dtype of mixed precision (``half``; None
    for fp32), its name (``precision``), and the ``topology`` (a key of ``TOPOLOGIES``)."""

    device: torch.device
    half: torch.dtype | None
    precision: str
    topology: str


class Recipe(NamedTuple):
    """``layers``: the names this backend answers to in a stack (``"ddp"``; ``"zero0"`` .. ``"zero3"``).
    ``build(layer, model, setting)``: ``model`` wrapped as ``layer`` says, with the backend's usual mixed
    precision. ``topologies``: the layouts besides ``"flat"`` it runs over. ``needs``: the optional library
    it takes. ``order``: where it stands among the backends the doctor lists, fewest shards first."""

    layers: tuple[str, ...]
    build: Callable[[str, torch.nn.Module, Setting], torch.nn.Module]
    order: int
    topologies: frozenset[str] = frozenset()
    needs: str | None = None


def whole(model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    """``model`` on the setting's device, in its half dtype where one is set: the usual mixed precision of
    a backend that keeps whole weights is half weights."""
    return model.to(device=setting.device, dtype=setting.half) if setting.half is not None else model.to(
        setting.device)


def two_d_mesh(device: torch.device) -> Any:
    """(replicate, shard): each half of the ranks holds one full copy, sharded over its half."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if world < 4 or world % 2:
        raise ValueError(f"a 2-D mesh needs an even world size of at least 4, not {world}")
    return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))


def halves() -> tuple[Any, Any]:
    """(this rank's half of the ranks, the group of the ranks at its position in the other half);
    the first is the data-parallel group of a "subgroup" layout, the second its model-parallel one."""
    mesh = two_d_mesh(torch.device("cpu"))
    return mesh.get_group("shard"), mesh.get_group("replicate")


class Mpu:
    """The model-parallel unit DeepSpeed takes (as Megatron provides it): data parallel over one
    half of the ranks, model parallel across the halves."""

    def __init__(self) -> None:
        self.dp, self.mp = halves()

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


def dp_tp_mesh(device: torch.device, hsdp: bool = False) -> Any:
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


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    """A DeepSpeed config at ZeRO ``stage``: one micro-batch, torch's AdamW, no step printing."""
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
