"""Never a silent ``plain``: a model another framework partitioned itself (pipeline stages, experts over
their own ranks, Megatron-Core's parallel layers) is refused at ``adapt()``, naming the parameter or module,
the mark and the fix. Each mark with its producer where one runs here (``wrapkit/adapters/core/foreign.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from wrapkit.adapters.core.foreign import foreign_marks


def _refusal(model: torch.nn.Module) -> str:
    with pytest.raises(wrapkit.UnsupportedModelError) as info:
        wrapkit.adapt(model)
    return str(info.value)


def test_deepspeed_moe_experts_are_refused() -> None:
    """DeepSpeed's MoE layer keeps each rank's own experts, marked ``allreduce=False``."""
    experts = pytest.importorskip("deepspeed.moe.experts")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), experts.Experts(torch.nn.Linear(4, 4), num_local_experts=2))
    message = _refusal(model)
    assert "1.deepspeed_experts.0.weight: allreduce=False" in message, message
    assert "(and 3 more)" in message and "or shard them with FSDP2 or ZeRO-3" in message, message
    assert {m.where for m in foreign_marks(model)} == {f"1.deepspeed_experts.{e}.{p}" for e in (0, 1)
                                                      for p in ("weight", "bias")}


def test_expert_parallel_experts_outside_fsdp2_are_refused() -> None:
    """transformers' mark on experts split over ranks is read beside FSDP2 only (tests/parallel/test_experts.py):
    on a model with no FSDP2 around it, the experts this rank holds would pass for all of them."""

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
            self.num_experts = 2
            self._is_expert_parallel = True

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Experts())
    message = _refusal(model)
    assert "1: 2 experts of this rank's only (_is_expert_parallel)" in message, message
    assert "DistributedConfig(ep_size=...)" in message and "fsdp_size" in message, message


def test_megatron_parallel_layers_are_refused() -> None:
    """Megatron-Core's parallel layers keep this rank's slice in a plain tensor, marked with the dimension: inside
    a module that is no Megatron model, they are refused."""
    layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    layers.set_tensor_model_parallel_attributes(model[0].weight, True, 0, 1)
    layers.set_tensor_model_parallel_attributes(model[1].weight, True, 1, 1)
    message = _refusal(model)
    assert "0.weight: tensor_model_parallel=True, partition_dim=0" in message and "(and 1 more)" in message, message
    assert [m.what.split(":")[0] for m in foreign_marks(model)] == [
        "tensor_model_parallel=True, partition_dim=0", "tensor_model_parallel=True, partition_dim=1"]
    assert "Megatron-Core" in message and "GPTModel" in message and "dist_checkpointing" in message, message
    # Megatron marks a layer it did not split as not parallel: that alone is no partitioning.
    plain = torch.nn.Linear(4, 4)
    layers.set_tensor_model_parallel_attributes(plain.weight, False, -1, 1)
    assert foreign_marks(plain) == [] and wrapkit.adapt(plain).backend == "plain"


def test_a_pipeline_placeholder_is_refused_under_any_wrapper() -> None:
    """transformers' placeholder for a layer another stage holds, inside a model a data-parallel wrapper holds:
    the mark is found below the wrapper as well."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    from wrapkit.cli._models import tiny_llama

    model: Any = tiny_llama(0)
    model.model.layers[1] = PipelineIdentityLayer()
    message = _refusal(torch.nn.DataParallel(model))
    assert "model.layers.1: a placeholder for a layer another pipeline stage holds" in message, message
    assert "without pipeline stages" in message


def test_an_unmarked_model_has_no_marks() -> None:
    from wrapkit.cli._families import FAMILIES, family_model

    for family in FAMILIES:
        assert foreign_marks(family_model(family, 0)) == [], family


def test_every_distributed_producer_is_refused_on_every_rank(group: Any, tmp_path: Path) -> None:
    """torch's stages cut by hand, and DTensors on a mesh dimension named for stages or experts outside FSDP2:
    refused on each rank, naming what that rank holds. transformers' own pipeline (pp_size) and experts (ep_size
    beside fsdp_size), and Megatron-Core's models, are read."""
    for rank, obs in enumerate(group.run("tests.adapters.scenarios_foreign:adapt_each", str(tmp_path), timeout=240)):
        # transformers' own stages are read (tests/parallel/test_pipeline.py); every other producer is refused.
        assert obs.pop("transformers-pp") == "adapted as pipeline", obs
        # And its experts split beside its FSDP2 (tests/parallel/test_experts.py); Megatron-Core's models are its own
        # backend (tests/parallel/test_megatron.py).
        assert obs.pop("transformers-ep") == "adapted as fsdp2", obs
        assert obs.pop("megatron-tp") == obs.pop("megatron-pp") == "adapted as megatron", obs
        for producer, said in obs.items():
            assert said.startswith("UnsupportedModelError: this model was partitioned by another framework"), \
                (rank, producer, said)
        assert "1.weight: a DTensor on a mesh dimension named 'ep'" in obs["mesh-ep"], obs["mesh-ep"]
        assert "1.weight: a DTensor on a mesh dimension named 'pp'" in obs["mesh-pp"], obs["mesh-pp"]
        emptied = "lm_head set to None" if rank == 0 else "embed_tokens set to None"
        assert emptied in obs["torch-pipelining"] and "torchtitan" in obs["torch-pipelining"], obs["torch-pipelining"]


def test_a_torchtitan_stage_keeps_its_layer_numbers() -> None:
    """torchtitan's own models keep layers in a ModuleDict under their global numbers: a later stage's start
    above 0."""

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in (2, 3)})

    message = _refusal(Stage())
    assert "Stage: layers 2-3 of a numbering that does not start at 0" in message, message
    first = Stage()
    first.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in (0, 1)})
    assert foreign_marks(first) == []  # the first stage of a split that keeps the head is no different from a model
