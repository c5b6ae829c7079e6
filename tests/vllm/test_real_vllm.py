"""wrapkit against a real vLLM: vLLM 0.32's CPU build serving a Llama, taking wrapkit's syncs over the gloo backend
that wrapkit registers as a vLLM plugin (``wrapkit/integrations/engines/vllm_gloo.py``). The oracle is the trained
model itself: the server's greedy tokens and log-probabilities on fixed prompts against its own, after a sync, a
training step and a sync again; between them (the server behind) the same comparison must fail."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm import scenarios_real as sc
from tests.vllm.server import Server
from wrapkit.cli._workers import free_port

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")

# Every backend that shards a Llama, ZeRO-3 and pipeline stages included, and LoRA synced merged.
SPECS = ["ddp", "fsdp", "fsdp2", "tp", "zero3", "pipeline", "ddp>peft", "zero3>peft"]


def test_the_plugin_is_registered_where_vllm_runs(llama_server: Server) -> None:
    """The server took ``--weight-transfer-config '{"backend": "gloo"}'``: the entry point reached every vLLM
    process, and the wire wrapkit speaks is accepted (0.32)."""
    assert llama_server.get("version")["version"].startswith("0.32")


def check_sync_step_sync(server: Server, specs: list[str], tensors: int, group: Any) -> None:
    """Each stack's model generates on the server as it does itself after a sync, and again after a step and a
    sync; between them (the server behind) it does not."""
    obs = group.run(sc.sync_step_sync, server.url, server.model, free_port(), specs, timeout=500)
    table = obs[0]
    for spec in specs:
        case = table[spec]
        print(f"{spec} ({case['backend']}): synced {case['synced']}, behind {case['behind']}, "
              f"again {case['again']}, seconds {case['seconds']}")
        assert case["tensors"] == tensors, case  # every Hub tensor of the two-layer model
        for when in ("synced", "again"):
            assert all(case[when]["tokens"]) and case[when]["logprob"] < 1e-4, (spec, when, case)
        assert not all(case["behind"]["tokens"]) or case["behind"]["logprob"] > 1e-2, (spec, case)


def test_sync_step_sync_matches_the_trained_model(group: Any, llama_server: Server) -> None:
    check_sync_step_sync(llama_server, SPECS, 21, group)


def test_refused_updates_leave_the_server_ready(group: Any, llama_server: Server) -> None:
    """A model of another shape is refused on every rank, naming what did not fit; a partial one (fewer layers),
    which vLLM itself would report done, too. The server is left paused (its weights may be partly the update's),
    and the right model's next sync succeeds the first time (vLLM would replay the failed update's buffered
    tensor) and resumes it: it then generates as that model."""
    obs = group.run(sc.failures, llama_server.url, llama_server.model, free_port(), timeout=400)
    for rank in obs:
        said = rank["unmerged adapters"]["error"]
        assert said.startswith("ArgumentError") and "merge_adapters=True" in said, said
        said = rank["vocabulary"]["error"]
        assert said.startswith("EngineError") and "loading model.embed_tokens.weight [264, 128] float32" in said, said
        assert "the model holds its previous weights" in said and "the server is left paused" in said, said
        assert rank["vocabulary"]["seconds"] < 30, rank["vocabulary"]
        said = rank["more layers"]["error"]  # a layer the server's model does not have: refused, named
        assert said.startswith("EngineError") and "loading model.layers.2." in said, said
        said = rank["fewer layers"]["error"]
        assert said.startswith("EngineError") and "gave no weights to 6 layers" in said, said
        assert "model.layers.1.self_attn.qkv_proj" in said, said
        for retry in ("right after", "right again", "right at last"):
            assert rank[retry]["error"] is None, (retry, rank[retry])
    first = obs[0]
    assert first["paused after unmerged"] is False and first["paused after refusal"] is True, first
    for when in ("generates", "generates at last"):
        assert all(first[when]["tokens"]) and first[when]["logprob"] < 1e-4, (when, first[when])


@pytest.mark.parametrize("spec", ["fsdp2", "zero3"])
def test_adapters_alone_through_vllms_lora_routes(group: Any, llama_server: Server, tmp_path: Any, spec: str) -> None:
    """``sync_adapters``: the served ``policy-vN`` generates as the trained PEFT model, after a sync and after a step
    and a sync; the version before the step is behind, and is unloaded by the next sync."""
    obs = group.run(sc.adapters, llama_server.url, llama_server.model, str(tmp_path), spec, timeout=300)
    case = obs[0]
    print(spec, case)
    assert case["tensors"] == 8, case  # lora_A and lora_B of q_proj and v_proj in two layers
    for when in ("synced", "again"):
        assert all(case[when]["tokens"]) and case[when]["logprob"] < 1e-4, (when, case)
    for when in ("behind", "base"):
        assert not all(case[when]["tokens"]) or case[when]["logprob"] > 1e-2, (when, case)
    assert case["unloaded"] == [case["names"][0]], case


def test_a_server_killed_mid_sync_fails_every_rank_at_once(group: Any, llama_server: Server) -> None:
    """Last in this module: it kills the module's server. Every rank raises within seconds, saying what failed and
    not a time-out it did not wait for, and the engine says to connect again."""
    obs = group.run(sc.killed_mid_sync, llama_server.url, llama_server.model, free_port(), llama_server.proc.pid,
                    timeout=200)
    print(obs)
    assert llama_server.proc.wait(30) is not None
    for rank in obs:
        assert rank["error"] is not None and rank["error"].startswith("EngineError"), rank
        assert rank["seconds"] < 30 and rank["connected"] is False, rank
        said = rank["error"]
        assert "update_weights got no answer" in said and "the server may be down" in said, said
        assert "was refused" not in said and "within 60 s" not in said, said
    assert obs[0]["error"] == obs[1]["error"], obs  # agreed
