"""wrapkit against a real vLLM: vLLM 0.32's CPU build serving a Llama, taking wrapkit's syncs over the gloo backend
that wrapkit registers as a vLLM plugin (``wrapkit/integrations/engines/vllm_gloo.py``). The oracle is the trained
model itself: the server's greedy tokens and log-probabilities on fixed prompts against its own, after a sync, a
training step and a sync again; between them (the server behind) the same comparison must fail."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm import scenarios_real as sc
from tests.vllm.conftest import Server, free_port

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")

SPECS = ["ddp", "fsdp", "fsdp2", "tp"]


def test_the_plugin_is_registered_where_vllm_runs(llama_server: Server) -> None:
    """The server took ``--weight-transfer-config '{"backend": "gloo"}'``: the entry point reached every vLLM
    process, and the wire wrapkit speaks is accepted (0.32)."""
    assert llama_server.get("version")["version"].startswith("0.32")


def test_sync_step_sync_matches_the_trained_model(group: Any, llama_server: Server) -> None:
    obs = group.run(sc.sync_step_sync, llama_server.url, llama_server.model, free_port(), SPECS, timeout=400)
    table = obs[0]
    for spec in SPECS:
        case = table[spec]
        print(f"{spec}: synced {case['synced']}, behind {case['behind']}, again {case['again']}, "
              f"seconds {case['seconds']}")
        assert case["tensors"] == 21, case  # every Hub tensor of the two-layer Llama
        for when in ("synced", "again"):
            assert all(case[when]["tokens"]) and case[when]["logprob"] < 1e-4, (spec, when, case)
        assert not all(case["behind"]["tokens"]) or case["behind"]["logprob"] > 1e-2, (spec, case)
