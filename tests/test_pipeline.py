"""Pipeline stages as transformers makes them (``DistributedConfig(pp_size=2)``), on two gloo ranks: adapted as
the ``pipeline`` backend, with every export, load and copy exact against the same checkpoint loaded whole."""

from __future__ import annotations

from typing import Any

import pytest

# A tied family (the last stage keeps the embedding for its head), the mixtures of experts (their Hub
# layout differs from the runtime one), and one in bf16.
CASES = [("llama4", "float32"), ("llama4", "bfloat16"), ("qwen2-tied", "float32"), ("gemma3", "float32"),
         ("qwen3-moe", "float32"), ("gpt-oss", "float32"), ("deepseek-v3", "float32")]


@pytest.mark.parametrize("name, dtype", CASES)
def test_every_operation_on_transformers_pipeline_stages(group: Any, tmp_path_factory: Any, name: str,
                                                         dtype: str) -> None:
    tmp = tmp_path_factory.getbasetemp() / "pipeline"
    tmp.mkdir(exist_ok=True)
    results = group.run("tests.scenarios_pipeline:pipeline_ops", str(tmp), name, dtype, timeout=240)
    for rank, r in enumerate(results):
        assert r["backend"] == "pipeline" and r["sharded"], (rank, r["backend"])
        assert r["world"] == (rank, 2) and r["batches"] == (0, 1), (rank, r["world"], r["batches"])
        assert f"pipeline:     stage {rank} of 2" in r["describe"], r["describe"]
        whole, mine = r["count"]
        assert whole == mine and r["trainable"][0] == r["trainable"][1] < whole, (rank, r["count"], r["trainable"])
        for op in ("full_state_dict", "named_full_parameters", "save_pretrained", "copy_to_whole", "copy_from_whole",
                   "copy_to_fsdp2", "copy_from_fsdp2"):
            assert r[op] == [], (rank, op, r[op][:3])
        assert r["stream"] == {"hub": [], "runtime": []}, (rank, r["stream"])
        assert r["rank0_only"], rank
        loaded, differ = r["load"]
        assert differ == [] and not loaded.missing_keys and not loaded.unexpected_keys, (rank, loaded, differ)
        assert r["sleep"] == (True, []), (rank, r["sleep"])
        assert r["forward"] == 0.0 and r["greedy"], (rank, r["forward"], r["greedy"])
        for op in ("gathered", "generation_full"):
            assert "each rank of this pipeline holds only its own stage's layers" in r[op], (op, r[op])
        # A frozen copy split into the same stages, its own storage, running the same pipeline forward.
        assert r["reference"] == ("pipeline", False, [], 0.0, False), (rank, r["reference"])
    # Each stage holds its own layers only: stage 0 the embedding, the last stage the norm and head.
    held = [set(r["held"]) for r in results]
    assert "model.embed_tokens.weight" in held[0] and "model.norm.weight" not in held[0], sorted(held[0])
    assert "model.norm.weight" in held[1] and not any(n.startswith("model.layers.0.") for n in held[1])
    # Sampling draws the first stage's random numbers on every stage, whatever each rank's generator held.
    assert results[0]["sampled"] == results[1]["sampled"]



def test_every_operation_on_torch_pipelining_stages(group: Any, tmp_path: Any) -> None:
    """A model cut as torchtitan cuts one, each rank's part in a ``PipelineStage``: exports, loads and copies
    exact, and after one GPipe step the stages hold what one step of the whole model gives."""
    results = group.run("tests.scenarios_pipeline:torch_pipeline_ops", str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        assert r["backend"] == "pipeline" and r["module"], (rank, r["backend"])
        assert r["count"][0] == r["count"][1], r["count"]
        for op in ("full_state_dict", "named_full_parameters", "stream", "copy_to"):
            assert r[op] == [], (rank, op, r[op][:3])
        for op in ("load_full_state_dict", "load"):
            result, differ = r[op]
            assert differ == [] and not result.missing_keys and not result.unexpected_keys, (rank, op, r[op])
        assert r["reference"] == ("pipeline", False, []), r["reference"]
        same_keys, diff = r["trained"]
        assert same_keys and diff < 1e-5, (rank, r["trained"])
    assert abs(results[1]["loss"]) < 1e-5, results[1]["loss"]


def test_stages_it_cannot_read_are_refused(group: Any) -> None:
    for r in group.run("tests.scenarios_pipeline:torch_pipeline_refusals", timeout=120):
        assert "renumbers the rest" in r["renumbered"], r["renumbered"]
        assert "several stages per rank" in r["virtual"], r["virtual"]


def test_lora_on_pipeline_stages_exports_and_refuses_a_partial_merge(group: Any, tmp_path: Any) -> None:
    for r in group.run("tests.scenarios_pipeline:pipeline_peft", str(tmp_path), timeout=120):
        assert r["backend"] == "pipeline" and r["unmerged"] == [], r
        for op in ("merged", "adapters_only"):
            assert "the other stages' adapters would be left out" in r[op], (op, r[op])
