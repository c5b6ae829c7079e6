"""torchtitan's own models, sharding, optimizer container and checkpoint layout
(``tests/integrations/torchtitan_run.py`` under torchrun on two gloo ranks), read by wrapkit.

torchtitan (with the triton its import needs on a CPU build) runs in an environment of its own; ``.ci/run`` builds
it. By hand::

    python3 -m venv .venv-titan && . .venv-titan/bin/activate && pip install torch==2.13.0 uv \\
        && uv pip install -e ".[transformers]" torchtitan==0.3.0 triton==3.7.1 pytest pytest-timeout \\
        && python -m pytest tests/integrations/test_torchtitan.py
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan.models.llama3", reason="torchtitan is not installed here (it needs an environment of its own: see "
    "tests/integrations/test_torchtitan.py's docstring, or run .ci/run, which builds one)")

from tests.harness.launch import ROOT, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("torchtitan")
    torchrun(ROOT / "tests" / "integrations" / "torchtitan_run.py", str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_reference_is_sharded_as_torchtitan_sharded_the_policy(ranks: list[dict[str, Any]]) -> None:
    for obs in ranks:
        assert obs["backend"] == "fsdp2"
        # torchtitan's units: the embedding, each block, the norm and the head together (the root aside).
        assert obs["policy_units"] == [["layers.0"], ["layers.1"], ["lm_head", "norm"], ["tok_embeddings"]], obs
        assert obs["reference_units"] == obs["policy_units"]
        assert obs["before_copy"] > 0 and obs["after_copy"] == 0.0, obs


def test_torchtitans_checkpoint_resumes_on_another_backend(ranks: list[dict[str, Any]]) -> None:
    for obs in ranks:
        assert obs["weights_equal"] and obs["moments_equal"], obs
        assert obs["lr"] == [1e-3], obs["lr"]
        assert obs["skipped"] and "scheduler" in obs["skipped"][0], obs["skipped"]


def test_a_fused_projection_saved_split_by_its_hooks_resumes(ranks: list[dict[str, Any]]) -> None:
    """torchtitan's checkpoint of a fused wqkv holds the weight as wq/wk/wv (its state-dict hooks) and the Adam
    moments under wqkv: load_state builds wqkv through the model's load hooks, and every moment lands."""
    for obs in ranks:
        fused = {k: v for k, v in obs.items() if k.startswith("fused")}
        assert obs["fused_resumed"] and obs["fused_moments"], json.dumps(fused)
        assert obs["fused_moment_keys"] == ["layers.0.attention.qkv_linear.wqkv.weight",
                                            "layers.1.attention.qkv_linear.wqkv.weight"], obs


def test_the_fused_projection_exports_and_loads_as_its_own_state_dict(ranks: list[dict[str, Any]]) -> None:
    """torchtitan's FusedQKVLinear saves wqkv as wq/wk/wv by a state-dict hook: full_state_dict and
    named_full_parameters give those names, torch's own load of them computes the sharded model's logits, and
    load_full_state_dict and a save()/load() file take them back."""
    for obs in ranks:
        assert obs["fused_keys"] and obs["fused_named"], obs
        assert obs["fused_logits"] == 0.0 and obs["fused_file_logits"] == 0.0, obs
        assert obs["fused_load"] == [[], []] and obs["fused_round_trip"], obs


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_torchtitans_own_adapter_gives_the_hub_layout(ranks: list[dict[str, Any]], family: str) -> None:
    """Sharded by torchtitan, the model saves and streams exactly what torchtitan's own StateDictAdapter.to_hf
    makes of the unsharded state dict; transformers' model of the config.json written beside it computes the same
    logits (torchtitan's grouped experts run in bf16: 1e-3 there), and so does one fed the default stream by
    load_into (a colocated engine's way in); a directory torchtitan's to_hf wrote loads.
    DeepSeek-V3 has no Hub config made here (its routing and rope scaling): its weights alone, no config.json."""
    for obs in ranks:
        got = obs[f"hub_{family}"]
        assert got["save_keys"] and got["save_values"] and got["stream"], got
        assert got["config"] == (family != "deepseek_v3"), got
        if got["config"]:
            tol = 1e-3 if family == "qwen3_moe" else 1e-5
            assert got["hf_logits"] < tol and got["fed_logits"] < tol, got
        assert got["load"] == [[], []] and got["loaded_equal"], got


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_torchtitans_models_take_deltas_diffed_on_their_shards(ranks: list[dict[str, Any]], family: str) -> None:
    """DeltaSync of torchtitan's models to vLLM's sparse receiver: the sparse rounds are diffed on each rank's
    FSDP2 shards, mapped to the Hub's coordinates through torchtitan's own to_hf (the fused wqkv split into q/k/v,
    the grouped experts per expert, the tied Qwen3's embedding once), and after each the receiver holds exactly what
    a dense stream gives."""
    for obs in ranks:
        syncs = obs[f"hub_{family}"]["delta"]
        assert [s[0] for s in syncs] == ["dense", "shards", "shards"], syncs
        assert [s[1] for s in syncs] == [None, None, None] and [s[2] for s in syncs] == [False, True, True], syncs
        assert all(s[3] == [] for s in syncs), syncs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_checkpoints_resume_and_references_are_sharded_alike(ranks: list[dict[str, Any]], family: str) -> None:
    """torchtitan's tied Qwen3 and Qwen3-MoE, sharded and stepped by torchtitan: its CheckpointManager checkpoint
    resumes on DDP with every weight and Adam moment equal, and a reference is sharded at the policy's units."""
    for obs in ranks:
        got = obs[f"resume_{family}"]
        assert got["weights_equal"] and got["moments_equal"] and got["units"], got


def test_torchtitans_expert_parallelism_is_read_whole(ranks: list[dict[str, Any]]) -> None:
    """Its EP as its trainer sets it up (sharding config with EP, parallelize over ep=2, FSDP on the experts' efsdp
    mesh): each rank holds 4 of 8 experts, its forward equals the unsharded model's; wrapkit's full state dict, Hub
    files and stream equal the unsharded model's and torchtitan's to_hf; a reference split alike takes its
    weights; a to_hf directory loads (each rank its experts) with that model's logits; torchtitan's checkpoint
    of a step resumes on DDP and on EP again, weights and Adam moments."""
    for obs in ranks:
        got = obs["expert_parallel"]
        assert got["local_experts"] == 4 and got["forward"] == 0.0, got
        assert got["full_state_dict"] and got["files"] and got["stream"] and got["reference"], got
        assert got["load"] == [[], []] and got["loaded_equal"] and got["loaded_forward"] < 1e-5, got
        assert got["resumed_ddp"] and got["moments_ddp"] and got["resumed_ep"] and got["moments_ep"], got


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_torchtitans_pipeline_stages_are_read_whole(ranks: list[dict[str, Any]], family: str) -> None:
    """Cut into two stages by torchtitan's pipeline_llm (1F1B, each stage parallelized by the family's own function):
    the full state dict is the unsharded model's own state_dict() (its fused projections split by each stage's own
    hooks), the Hub files and the stream are torchtitan's to_hf, gathered() computes its logits; a reference passed
    in cut alike takes the policy's weights (rebuilt whole, it is refused); a to_hf directory loads into the
    stages and the schedule's loss is then the loss of the model it came from; torchtitan's checkpoint of a
    stepped pipeline resumes on DDP and on stages, weights and every stage's Adam moments, and so does wrapkit's
    own save_state of the stages."""
    for obs in ranks:
        got = obs[f"pipeline_{family}"]
        assert got["stack"][:2] == ["pipeline", "fsdp2"], got
        assert got["full_state_dict"] and got["files"] and got["stream"] and got["gathered"] == 0.0, got
        assert "pass its PipelineStage as ref_model" in got["copy_refused"] and got["reference"], got
        assert got["load"] == [[], []] and got["loaded_equal"], got
        assert got["resumed_ddp"] and got["resumed_stages"], got  # weights and every stage's moments
        assert got["own_ddp"] and got["own_stages"], got  # wrapkit's own save_state of the stages
    last = ranks[1][f"pipeline_{family}"]
    # Two microbatches' mean against the whole batch's: a rounding apart (torchtitan's grouped experts compute in
    # bf16); the loss of the model the stages held before the load is far off.
    assert ranks[0][f"pipeline_{family}"]["loss"] is None and last["loss"] is not None, last
    assert last["loss_apart"] > 1e-2 and last["loss"] < last["loss_apart"] / 10, last
