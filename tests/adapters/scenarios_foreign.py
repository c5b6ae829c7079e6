"""Models another framework partitioned itself, on two gloo ranks: what ``adapt()`` says of each producer of a
mark (``wrapkit/adapters/core/foreign.py``) that runs here. Each is refused on every rank, never taken for plain."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._families import family_model
from wrapkit.cli._models import tiny_llama


def saved(tmp: str, name: str, build: Callable[[], torch.nn.Module]) -> str:
    """``build()``'s ``save_pretrained`` directory under ``tmp`` (written once, by rank 0), on every rank."""
    directory = os.path.join(tmp, name)
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        build().save_pretrained(directory)
    dist.barrier()
    return directory


def _transformers_pp(tmp: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    directory = saved(tmp, "llama4", lambda: tiny_llama(0, layers=4))
    return LlamaForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(pp_size=2))


def _transformers_ep(tmp: str) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    directory = saved(tmp, "qwen3-moe", lambda: family_model("qwen3-moe", 0))
    return Qwen3MoeForCausalLM.from_pretrained(directory,
                                               distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))


def _torch_pipelining(tmp: str) -> torch.nn.Module:
    """A stage as torchtitan cuts one: every layer built, then those of the other stage deleted, and the
    embedding (last stage) or the norm and head (first stage) set to None; ``PipelineStage`` runs it."""
    from torch.distributed.pipelining import PipelineStage

    model: Any = tiny_llama(0, layers=4)
    rank = dist.get_rank()
    if rank == 0:
        del model.model.layers[2:]
        model.model.norm = None
        model.lm_head = None
    else:
        del model.model.layers[:2]
        model.model.embed_tokens = None
    stage = PipelineStage(model, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    submod: torch.nn.Module = stage.submod
    return submod


def _megatron(tp: int, pp: int) -> Callable[[str], torch.nn.Module]:
    """A tiny Megatron-Core ``GPTModel`` on the two ranks: split over them (``tp=2``), or one stage on each
    (``pp=2``). Built on the CPU from full weights sliced per rank (``use_cpu_initialization``); Megatron's
    parallel state stays initialised, as in a training run."""
    def build(tmp: str) -> torch.nn.Module:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                                   pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp)
        model: torch.nn.Module = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                                          pre_process=parallel_state.is_pipeline_first_stage(),
                                          post_process=parallel_state.is_pipeline_last_stage())
        return model
    return build


def _on_mesh_dimension(name: str) -> Callable[[str], torch.nn.Module]:
    def build(tmp: str) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[1].weight = torch.nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh, [Shard(0)]))
        return model
    return build


PRODUCERS: dict[str, Callable[[str], torch.nn.Module]] = {
    "transformers-pp": _transformers_pp,
    "transformers-ep": _transformers_ep,
    "torch-pipelining": _torch_pipelining,
    "megatron-tp": _megatron(tp=2, pp=1),
    "megatron-pp": _megatron(tp=1, pp=2),
    "mesh-ep": _on_mesh_dimension("ep"),
    "mesh-pp": _on_mesh_dimension("pp"),
}


def adapt_each(tmp: str) -> dict[str, Any]:
    """For each producer: its model's class, and what ``adapt()`` raised (or the backend it adapted as)."""
    out: dict[str, Any] = {}
    for name, build in PRODUCERS.items():
        model = build(tmp)
        try:
            out[name] = f"adapted as {wrapkit.adapt(model).backend}"
        except wrapkit.WrapkitError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
