"""TRL's real ``GRPOTrainer`` generating with a real vLLM server (server mode), its weights sent by wrapkit's
``VLLMEngine`` (``patch_trl(vllm_server=True)``), on two CPU ranks (``tests/vllm/trl_loop.py`` under torchrun).
The check at every step: vLLM's log-probabilities of the tokens it sampled against the trainer's own of the same
tokens (TRL's ``sampling/sampling_logp_difference/max``), within 1e-4; a run that never syncs must fail it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch import torchrun
from tests.vllm.server import Server, trl_dir
from wrapkit.cli._workers import free_port

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")
pytest.importorskip("trl", reason="TRL is installed in the vLLM stage's environment (.ci/vllm)")

SCRIPT = Path(__file__).with_name("trl_loop.py")
STEPS = 4


def grpo(server: Server, tmp_path: Path, backend: str, *extra: str, family: str = "llama") -> dict[str, Any]:
    """The loop's observations: the trainer's model is ``family``'s tiny model with a tokenizer (the server may
    serve it without one: TRL sends token ids)."""
    out = tmp_path / "obs.json"
    model = trl_dir(tmp_path, family)
    torchrun(SCRIPT, "--backend", backend, "--family", family, "--model", model, "--url", server.url,
             "--group-port", str(free_port()), "--steps", str(STEPS), "--json", str(out), *extra, timeout=250)
    ranks = json.loads(out.read_text())
    assert ranks[0] == ranks[1]  # TRL gathers the metric over the ranks; the syncs are agreed
    print(family, backend, *extra, ranks[0])
    return ranks[0]  # type: ignore[no-any-return]


def check_grpo(server: Server, tmp_path: Path, backend: str, lora: bool, family: str = "llama") -> None:
    obs = grpo(server, tmp_path, backend, *(["--lora"] if lora else []), family=family)
    assert obs["syncs"] == list(range(1, STEPS + 1)), obs  # one checked update before each step's generation
    assert len(obs["diff"]) == STEPS and max(obs["diff"]) < 1e-4, obs


# Every backend TRL trains on; LoRA (merged for the sync, not in place) where merging is hardest: FSDP1's flat
# shards and ZeRO-3's partitions. The families' rows are in test_real_vllm_families.py.
@pytest.mark.parametrize("backend, lora", [("ddp", False), ("fsdp", False), ("fsdp2", False), ("zero3", False),
                                           ("fsdp", True), ("zero3", True)],
                         ids=["ddp", "fsdp", "fsdp2", "zero3", "fsdp>lora", "zero3>lora"])
def test_grpo_server_mode_generates_from_the_trained_weights(trl_llama_server: Server, tmp_path: Path,
                                                             backend: str, lora: bool) -> None:
    check_grpo(trl_llama_server, tmp_path, backend, lora)


def test_grpo_server_mode_without_syncs_fails_the_check(trl_llama_server: Server, tmp_path: Path) -> None:
    """The measure can fail: the server left with the weights it started from (or a previous run's) is off by far
    more than the bound from the second step on, once the policy has moved."""
    obs = grpo(trl_llama_server, tmp_path, "ddp", "--no-sync")
    assert obs["syncs"] == [], obs
    assert min(obs["diff"][1:]) > 1e-2, obs
