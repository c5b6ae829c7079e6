"""``DeltaSync`` against a real vLLM: the server runs wrapkit's ``sparse_gloo`` backend (vLLM's sparse engine, its
patches over gloo, applied in place through the model's loaders; on the CPU build the linear layers compute from
their own weights so that the patches reach them), and ``VLLMEngine.send_patches`` sends each round. Oracle: the
server generates as the trained model after a dense first round and after sparse rounds that each changed a
seventh of the values; before each sparse round, it does not."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm import scenarios_real as sc
from tests.vllm.server import Server
from wrapkit.cli._workers import free_port

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")

SPECS = ["fsdp2", "tp", "ddp"]


def test_delta_sync_through_the_sparse_gloo_backend(group: Any, sparse_server: Server) -> None:
    obs = group.run(sc.deltas, sparse_server.url, sparse_server.model, free_port(), SPECS, timeout=400)
    for spec in SPECS:
        rounds = obs[0][spec]
        for i, r in enumerate(rounds):
            print(spec, i, r)
            assert all(r["synced"]["tokens"]) and r["synced"]["logprob"] < 1e-4, (spec, i, r)
        assert rounds[0]["report"]["dense"] and rounds[0]["report"]["tensors"] == 21, rounds[0]
        for r in rounds[1:]:
            report = r["report"]
            assert not report["dense"] and report["diffed"] == "shards", report
            assert 0 < report["changed"] < report["values"] / 5, report  # about a seventh went
            assert not all(r["behind"]["tokens"]) or r["behind"]["logprob"] > 1e-2, r
