"""TRL's trainers against a real vLLM server, on two CPU ranks (scripts under torchrun).

- ``GRPOTrainer`` in server mode (``trl_loop.py``), its weights sent by wrapkit's ``VLLMEngine``
  (``patch_trl(vllm_server=True)``). The check at every step: vLLM's log-probabilities of the tokens it sampled
  against the trainer's own of the same tokens (TRL's ``sampling/sampling_logp_difference/max``), within 1e-4.
- ``AsyncGRPOTrainer`` with ``VLLMEngine`` as its ``weight_transfer`` (``trl_async.py``): its own sync
  (``_sync_weight``, on wrapkit's stream under ``patch_trl()``) around optimizer steps; the server's greedy tokens
  and log-probabilities against the policy's own after each sync. (Its training step needs a GPU kernel.)

A run that never syncs must fail each check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch import torchrun
from tests.vllm.server import Server, compared, trl_dir
from wrapkit.cli._workers import free_port

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")
pytest.importorskip("trl", reason="TRL is installed in the vLLM stage's environment (.ci/vllm)")

SCRIPT = Path(__file__).with_name("trl_loop.py")
ASYNC = Path(__file__).with_name("trl_async.py")
STEPS = 4


def grpo(server: Server | None, tmp_path: Path, backend: str, *extra: str, family: str = "llama",
         script: Path = SCRIPT) -> dict[str, Any]:
    """The run's observations (rank 0's): the trainer's model is ``family``'s tiny model with a tokenizer (the
    server may serve it without one: TRL sends token ids). No server: colocate mode, an engine in each rank."""
    out = tmp_path / "obs.json"
    model = trl_dir(tmp_path, family)
    url = server.url if server is not None else "http://127.0.0.1:9"
    # In-process engines (colocate mode): the engine core in the rank's own process, where TRL reaches its model.
    env = {} if server is not None else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                                          "VLLM_TARGET_DEVICE": "cpu"}
    torchrun(script, "--backend", backend, "--family", family, "--model", model, "--url", url,
             "--group-port", str(free_port()), "--steps", str(STEPS), "--json", str(out), *extra,
             *(["--colocate"] if server is None else []), timeout=250, **env)
    ranks = json.loads(out.read_text())
    if script == SCRIPT:
        assert ranks[0] == ranks[1]  # TRL gathers the metric over the ranks; the syncs are agreed
    print(family, backend, *extra, {k: v for k, v in ranks[0].items() if k != "own"})
    return ranks[0]  # type: ignore[no-any-return]


def check_grpo(server: Server | None, tmp_path: Path, backend: str, lora: bool, family: str = "llama") -> None:
    obs = grpo(server, tmp_path, backend, *(["--lora"] if lora else []), family=family)
    assert obs["syncs"] == list(range(1, STEPS + 1)), obs  # one checked update before each step's generation
    assert len(obs["diff"]) == STEPS and max(obs["diff"]) < 1e-4, obs


# Every backend TRL trains on; LoRA (merged for the sync, not in place) where TRL's own merge raises: FSDP1's flat
# shards. (The families: in colocate mode below and test_real_vllm_families.py.)
@pytest.mark.parametrize("backend, lora", [("ddp", False), ("fsdp2", False), ("zero3", False), ("fsdp", True)],
                         ids=["ddp", "fsdp2", "zero3", "fsdp>lora"])
def test_grpo_server_mode_generates_from_the_trained_weights(trl_llama_server: Server, tmp_path: Path,
                                                             backend: str, lora: bool) -> None:
    check_grpo(trl_llama_server, tmp_path, backend, lora)


def test_grpo_server_mode_without_syncs_fails_the_check(trl_llama_server: Server, tmp_path: Path) -> None:
    """The measure can fail: the server left with the weights it started from (or a previous run's) is off by far
    more than the bound from the second step on, once the policy has moved."""
    obs = grpo(trl_llama_server, tmp_path, "ddp", "--no-sync")
    assert obs["syncs"] == [], obs
    assert min(obs["diff"][1:]) > 1e-2, obs


def check_async(server: Server, tmp_path: Path, backend: str, lora: bool, family: str = "llama") -> None:
    obs = grpo(server, tmp_path, backend, *(["--lora"] if lora else []), family=family, script=ASYNC)
    assert obs["patched"] and obs["model_version"] == STEPS, obs  # a sync per step, each on wrapkit's stream
    for seen in obs["rounds"]:
        assert all(seen["tokens"]) and seen["logprob"] < 1e-4, obs
    # The policy moved between the first sync and the last: a server left behind would show it.
    moved = compared(obs["own"][0], obs["own"][-1])
    assert not all(moved["tokens"]) or moved["logprob"] > 1e-2, moved


# LoRA on the two backends whose live weights TRL's own in-place merge would move (FSDP2's and ZeRO-3's shards).
@pytest.mark.parametrize("backend, lora", [("fsdp", False), ("fsdp2", True), ("zero3", True)],
                         ids=["fsdp", "fsdp2>lora", "zero3>lora"])
def test_async_grpo_weight_transfer_on_vllm_engine(trl_llama_server: Server, tmp_path: Path, backend: str,
                                                   lora: bool) -> None:
    check_async(trl_llama_server, tmp_path, backend, lora)


def test_async_grpo_without_syncs_fails_the_check(trl_llama_server: Server, tmp_path: Path) -> None:
    """A server left behind holds one set of weights, and the policy takes four (a step between each): they
    cannot all match."""
    obs = grpo(trl_llama_server, tmp_path, "ddp", "--no-sync", script=ASYNC)
    assert obs["model_version"] == 0, obs
    assert any(not all(seen["tokens"]) or seen["logprob"] > 1e-2 for seen in obs["rounds"]), obs


# (FSDP1's colocated engines: online DPO's below; engines start in each rank, a minute a run.)
@pytest.mark.parametrize("family, backend", [("qwen3-moe", "fsdp2"), ("qwen2-tied", "zero3")],
                         ids=["qwen3-moe-fsdp2", "qwen2-tied-zero3"])
def test_grpo_colocate_mode_on_the_cpu_build(tmp_path: Path, family: str, backend: str) -> None:
    """TRL's colocate mode: an engine in each rank's process, loaded by TRL's own sync (its walk wrapkit's stream).
    On vLLM's CPU build it raises without ``patch_trl()`` (its packed linear layers take no load), and a mixture's
    experts keep their old values (log-prob gaps of 0.03 to 0.08 here) without their repacking."""
    check_grpo(None, tmp_path, backend, False, family=family)


ONLINE_DPO = Path(__file__).with_name("trl_online_dpo.py")


def check_online_dpo(tmp_path: Path, backend: str, lora: bool, family: str = "llama") -> None:
    obs = grpo(None, tmp_path, backend, *(["--lora"] if lora else []), family=family, script=ONLINE_DPO)
    assert obs["patched"] and len(obs["rounds"]) == STEPS, obs  # a sync before each step's generation
    for seen in obs["rounds"]:
        assert all(seen["tokens"]) and seen["logprob"] < 1e-4, obs
    moved = compared(obs["own"][0], obs["own"][-1])  # the policy moved: an engine left behind would show it
    assert not all(moved["tokens"]) or moved["logprob"] > 1e-2, moved


@pytest.mark.parametrize("family, backend, lora", [("llama", "fsdp", True), ("qwen2-tied", "zero3", False)],
                         ids=["llama-fsdp>lora", "qwen2-tied-zero3"])
def test_online_dpo_colocate_mode_on_wrapkits_stream(tmp_path: Path, family: str, backend: str, lora: bool) -> None:
    """TRL's online DPO in colocate mode: its sync (its own walk: FSDP1's LoRA merge raises on the flat shards) on
    wrapkit's stream, into each rank's engine; the engine's greedy output against the policy's own after each."""
    check_online_dpo(tmp_path, backend, lora, family)


def test_online_dpo_without_syncs_fails_the_check(tmp_path: Path) -> None:
    """The engine left with the weights it started from: once the policy has moved, they part."""
    obs = grpo(None, tmp_path, "ddp", "--no-sync", script=ONLINE_DPO)
    assert len(obs["rounds"]) == STEPS and all(obs["rounds"][0]["tokens"]), obs  # both start from one checkpoint
    assert any(not all(seen["tokens"]) or seen["logprob"] > 1e-2 for seen in obs["rounds"][1:]), obs
