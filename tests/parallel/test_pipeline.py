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
    results = group.run("tests.parallel.scenarios_pipeline:pipeline_ops", str(tmp), name, dtype, timeout=240)
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
        # Generation runs the stages' own forward (layerwise) or the whole model built on every rank (full).
        assert r["forward"] == 0.0 and r["greedy"] == {"layerwise": (True, True), "full": (False, True)}, \
            (rank, r["forward"], r["greedy"])
        # gathered(): the whole model, exact, as a module of its own; a change on one rank reaches every stage.
        assert r["gathered"] == (False, [], 0.0) and r["modified"] == [], (rank, r["gathered"], r["modified"])
        # A frozen copy split into the same stages, its own storage, running the same pipeline forward.
        assert r["reference"] == ("pipeline", False, [], 0.0, False), (rank, r["reference"])
    # Each stage holds its own layers only: stage 0 the embedding, the last stage the norm and head.
    held = [set(r["held"]) for r in results]
    assert "model.embed_tokens.weight" in held[0] and "model.norm.weight" not in held[0], sorted(held[0])
    assert "model.norm.weight" in held[1] and not any(n.startswith("model.layers.0.") for n in held[1])
    # Sampling draws the first stage's random numbers on every stage, whatever each rank's generator held.
    for gather in ("layerwise", "full"):
        assert results[0]["sampled"][gather] == results[1]["sampled"][gather], gather



@pytest.mark.parametrize("wrap", ["none", "fsdp2", "ddp"])
def test_every_operation_on_torch_pipelining_stages(request: Any, tmp_path: Any, wrap: str) -> None:
    """A model cut as torchtitan cuts one, each rank's part in a ``PipelineStage``, alone (two ranks) or on a
    (pp, dp) mesh of four with each stage sharded by FSDP2 or replicated by DDP: exports, loads and copies exact,
    and after one GPipe step the stages hold what one step of the whole model gives on the same batches."""
    group = request.getfixturevalue("group" if wrap == "none" else "group4")
    results = group.run("tests.parallel.scenarios_pipeline:torch_pipeline_ops", str(tmp_path), wrap, timeout=180)
    for rank, r in enumerate(results):
        if wrap == "none":
            assert r["backend"] == "pipeline" and r["batches"] == (0, 1), (rank, r["backend"], r["batches"])
        else:
            # The backend within each stage; the stages share its batches (dp rank, of 2).
            assert r["backend"] == wrap and r["stack"][:2] == ("pipeline", wrap), (rank, r["stack"])
            assert r["batches"] == (rank % 2, 2) and r["stage"] == rank // 2, (rank, r["batches"], r["stage"])
            assert "different wrapkit operations, or the same one with different arguments" in r["mismatch"], \
                (rank, r["mismatch"])
        assert f"pipeline:     stage {r['stage']} of 2" in r["describe"], r["describe"]
        assert "TitanLike has no config to build the whole model from" in r["gathered"], r["gathered"]
        assert r["module"] and r["count"][0] == r["count"][1], (rank, r["count"])
        for op in ("full_state_dict", "named_full_parameters", "stream", "copy_to", "save_pretrained"):
            assert r[op] == [], (rank, op, r[op][:3])
        for op in ("load_full_state_dict", "load"):
            result, differ = r[op]
            assert differ == [] and not result.missing_keys and not result.unexpected_keys, (rank, op, r[op])
        # A frozen copy over the same stages: DDP's is the stage's module alone; a sharded stage's is passed in.
        assert r["reference"] == (wrap if wrap == "fsdp2" else "pipeline", False, []), r["reference"]
        if wrap == "fsdp2":
            assert "pass its PipelineStage as ref_model" in r["copy_refused"], r["copy_refused"]
        same_keys, diff = r["trained"]
        assert same_keys and diff < 1e-5, (rank, r["trained"])
    for r in results[-2 if wrap != "none" else -1:]:  # the last stage's ranks compute the loss
        assert abs(r["loss"]) < 1e-5, r["loss"]
    for rank, r in enumerate(results):  # save_state of the stages, read into the whole model and the stages again
        state = r["state"]
        assert state["whole"] == [] and state["whole_momenta"] and state["whole_lr"] == [0.1], (rank, state)
        assert state["stages"] == [] and state["stage_momenta"], (rank, state)


def test_stages_it_cannot_read_are_refused(group: Any) -> None:
    for r in group.run("tests.parallel.scenarios_pipeline:torch_pipeline_refusals", timeout=120):
        assert "renumbers the rest" in r["renumbered"], r["renumbered"]
        assert "several stages per rank" in r["virtual"], r["virtual"]
        assert "reads stages beside fsdp2 or ddp only" in r["dataparallel"], r["dataparallel"]


def test_lora_on_pipeline_stages_exports_merges_and_saves_every_stages_adapters(group: Any, tmp_path: Any) -> None:
    for r in group.run("tests.parallel.scenarios_pipeline:pipeline_peft", str(tmp_path), timeout=120):
        assert r["backend"] == "pipeline", r
        for op in ("unmerged", "merged", "streamed_merged", "saved_merged", "adapters_only"):
            assert r[op] == [], (op, r[op][:3])
        assert r["adapters_loaded"] == ([], [], []), r["adapters_loaded"]


def test_the_plan_orders_names_as_the_whole_model_does() -> None:
    """Stages append their layers after the earlier stages' (a tied head's copy on the last stage keeps the
    embedding's place); another owner's experts within a layer every owner holds go between that layer's names."""
    from wrapkit.adapters.stages.plan import _merged

    stages = [["embed", "l0.a", "l1.a"], ["l2.a", "l3.a", "norm", "embed"]]
    assert _merged(stages) == ["embed", "l0.a", "l1.a", "l2.a", "l3.a", "norm"]
    experts = [["embed", "l0.router", "l0.e0", "l0.e1", "l1.norm", "l1.router", "l1.e0", "l1.e1", "head"],
               ["embed", "l0.router", "l0.e2", "l0.e3", "l1.norm", "l1.router", "l1.e2", "l1.e3", "head"]]
    assert _merged(experts) == ["embed", "l0.router", "l0.e0", "l0.e1", "l0.e2", "l0.e3", "l1.norm", "l1.router",
                                "l1.e0", "l1.e1", "l1.e2", "l1.e3", "head"]
