"""Tensor parallelism alone (``parallelize_module`` on every rank, no wrapper): adapted as the ``tp``
backend, and every operation gives the unsharded model's values and greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness._matrix import long
from tests.parallel import scenarios_tp as sc
from tests.parallel.scenarios_tp import TP_SIZE
from wrapkit.cli._workers import WorkerGroup


def check(results: list[dict[str, Any]], dtype: str, backend: str = "tp", producer: str = "torch") -> None:
    for obs in results:
        assert obs["backend"] == backend and obs["is_sharded"] and obs["stack"][-2:] == (backend, "LlamaForCausalLM")
        assert obs["split"] and obs["num_parameters"]
        assert obs["tp_forward"] < (1e-5 if dtype == "float32" else 5e-2)
        assert obs["reference_forward"] == obs["tp_forward"]  # the same TP forward, frozen
        for key in ("full_state_dict", "named_full", "gathered_plain_params", "generation_full",
                    "generation_layerwise", "stream", "copy_to_plain", "copy_from_plain", "copy_tp_to_tp",
                    "from_pretrained", "load_dir", "save_load_file", "load_full_state_dict", "modifier_write",
                    "place", "reference", "sleep_wake", "adapt_after_forward"):
            assert obs[key] is True, f"rank {obs['rank']}, {dtype}: {key}"
        # The gathered model is the plain module on full weights: the plain model's logits exactly.
        assert obs["gathered_forward"] == 0.0
        assert obs["files"] > 1
        assert f"backend:      {backend}" in obs["describe"]
        if backend == "tp":
            # Both ranks of a tensor-parallel model take the same batch.
            assert obs["world_size"] == 2 and obs["data_parallel"] == (0, 1)
            assert "mesh:         tp=2 tp" in obs["describe"], obs["describe"]
        else:
            # One copy over four ranks; the two along tp share a batch, those along dp (and across copies)
            # take their own.
            copies = len(results) // 4
            assert obs["world_size"] == 4, obs["world_size"]
            assert obs["data_parallel"] == (obs["global_rank"] // 2, 2 * copies), obs["data_parallel"]
            # transformers names its shard dimension fsdp, the tests' own meshes dp.
            dp = "fsdp" if producer == "transformers-fsdp2" else "dp"
            mesh = "replicate=2 replicate, shard=2 shard, tp=2 tp" if copies == 2 else f"{dp}=2 shard, tp=2 tp"
            assert f"mesh:         {mesh}" in obs["describe"], obs["describe"]
        if producer.startswith("transformers"):
            # transformers recorded how it distributed the model: the frozen copy is laid out again that way.
            assert obs["fresh_reference"] == f"built {backend} frozen=True diff=0.0", obs["fresh_reference"]
        else:
            refusal = "the tp backend cannot build" if backend == "tp" else "keeps no record of its plan"
            assert refusal in obs["fresh_reference"], obs["fresh_reference"]

# The bf16 repeats on a mesh are long; the tensor-parallel model alone keeps bf16 in the default selection.
BF16_LONG = long("bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_operation_on_a_tensor_parallel_model(group: Any, tmp_path: Path, dtype: str) -> None:
    check(group.run(sc.operations, str(tmp_path), dtype, timeout=240), dtype)


def test_tensor_parallel_over_one_dimension_of_a_mesh(group4: Any, tmp_path: Path) -> None:
    """Four ranks, a (dp, tp) mesh, tensor parallel over ``tp`` alone: two models of two ranks each."""
    check(group4.run(sc.operations, str(tmp_path), "float32", timeout=300), "float32")


@pytest.mark.parametrize("dtype", ["float32", BF16_LONG])
def test_a_model_transformers_loaded_with_a_tp_plan(group: Any, tmp_path: Path, dtype: str) -> None:
    """``from_pretrained(..., tp_plan="auto")``: transformers replaces each layer's ``forward`` instead of
    hooking it; gathered, the model still runs as the plain module."""
    check(group.run(sc.operations, str(tmp_path), dtype, "transformers", timeout=240), dtype, "tp", "transformers")


def test_sequence_parallel_as_transformers_distributes_it(group: Any, tmp_path: Path) -> None:
    """``DistributedConfig(tp_size=2, enable_sequence_parallel=True)``: the layer norms' inputs are cut along
    the sequence between the split layers; the parameters lie as under tensor parallelism alone."""
    check(group.run(sc.operations, str(tmp_path), "float32", "transformers-sp", timeout=240), "float32", "tp",
          "transformers-sp")


@pytest.mark.parametrize("dtype", ["float32", BF16_LONG])
def test_fsdp2_beside_tensor_parallelism_as_transformers_distributes_it(group4: Any, tmp_path: Path,
                                                                       dtype: str) -> None:
    """``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``: transformers
    applies its plan and ``fully_shard`` itself, embeddings and head split too (so after a no-grad forward
    the unsharded root's parameters lie on the tp dimension alone)."""
    check(group4.run(sc.operations, str(tmp_path), dtype, "transformers-fsdp2", timeout=300), dtype, "fsdp2",
          "transformers-fsdp2")


@pytest.mark.parametrize("dtype", ["float32", BF16_LONG])
def test_every_operation_on_fsdp2_beside_tensor_parallelism(group4: Any, tmp_path: Path, dtype: str) -> None:
    """Four ranks, a (dp, tp) mesh: tensor parallel over ``tp``, then ``fully_shard`` per block over ``dp``.
    One model over every rank, its split layers ``_StridedShard`` over dp and ``Shard`` over tp."""
    check(group4.run(sc.operations, str(tmp_path), dtype, "fsdp2", timeout=300), dtype, "fsdp2")


@pytest.fixture(scope="module")
def group8() -> Iterator[WorkerGroup]:
    """Eight gloo ranks, for the 3-D layout alone."""
    g = WorkerGroup(world_size=8, backend="gloo", preload=("transformers",))
    yield g
    g.close()


@pytest.mark.long
def test_every_operation_on_hsdp_beside_tensor_parallelism(group8: Any, tmp_path: Path) -> None:
    """Eight ranks, a (replicate, shard, tp) mesh of 2 x 2 x 2: tensor parallel over ``tp``, FSDP2 over the
    other two. Two copies of one model, each over four ranks."""
    check(group8.run(sc.operations, str(tmp_path), "float32", "hsdp", timeout=400), "float32", "fsdp2")


@pytest.mark.gpu
def test_a_model_accelerate_prepared_with_a_parallelism_config_gpu(gpu_group: Any, tmp_path: Path) -> None:
    if gpu_group.world_size < TP_SIZE:
        pytest.skip("accelerate's tensor parallelism here splits over two GPUs")
    for obs in gpu_group.run(sc.accelerate_tp, str(tmp_path), timeout=300):
        assert obs == {"backend": "tp", "world_size": 2, "tokens": True, "weights": True}, obs
