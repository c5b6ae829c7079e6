"""TRL's own weight sync to vLLM (``VLLMGeneration.sync_weights``, as GRPO, RLOO and distillation call it) after
``patch_trl()``: on every backend accelerate prepares, for every family of the matrix, in server and colocate
mode, exactly the Hub's tensors, for a sync before any forward and another after a training step."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations import scenarios_trl_sync as sc

pytest.importorskip("trl")
pytest.importorskip("accelerate")

CASES = [{"family": "llama"}, {"family": "qwen2-tied"}, {"family": "qwen3-moe"}, {"family": "llama", "peft": "lora"},
         {"family": "llama", "peft": "lora-mts"}, {"family": "qwen2-vl"}]


def _check(obs: list[list[dict[str, Any]]]) -> None:
    for rank_obs in obs:
        for o in rank_obs:
            assert "train" not in o, (o["family"], o["train"])
            assert len(o["syncs"]) == 2
            for sync in o["syncs"]:
                # Every rank's in-process engine, and the main process's client, got exactly the Hub's tensors.
                assert sync["colocate"] == [], (o["family"], o.get("peft"), sync["colocate"][:3])
                if o["rank"] == 0:
                    assert sync["server"] == [] and sync["server_metadata"] == [], (o["family"], sync)
                assert sync["live_changed"] == [], "a sync moved the trained weights"


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp2", "zero3"])
def test_trl_sync_weights(group: Any, kind: str) -> None:
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    _check(group.run(sc.trl_sync, kind, CASES, timeout=300))


@pytest.mark.parametrize(("kind", "families"), [("tp", ["llama", "qwen3-moe"]), ("pipeline", ["qwen2-tied"])])
def test_trl_sync_weights_split_models(group: Any, kind: str, families: list[str]) -> None:
    """Layouts TRL's sync has no branch for (tensor parallelism, transformers' pipeline stages): the helper is
    handed the split model, and wrapkit reads it whole."""
    _check(group.run(sc.trl_sync, kind, [{"family": f} for f in families], timeout=300))


@pytest.mark.parametrize("kind", ["zero3", "zero2", "fsdp"])
def test_trl_sync_weights_with_no_wrapper_listed(group: Any, kind: str) -> None:
    """The accelerator lists no prepared model, so TRL's helper holds only the module inside the wrapper: under
    DeepSpeed wrapkit finds the engine from the module and sends exactly the Hub's tensors; inside FSDP1, whose
    wrapper cannot be found, the sync raises naming the wrapper to pass, on every rank, and sends nothing."""
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    cases = [{"family": "llama", "unlisted": True}, {"family": "qwen3-moe", "peft": "lora", "unlisted": True}]
    obs = group.run(sc.trl_sync, kind, cases, timeout=300)
    if kind != "fsdp":
        _check(obs)
        return
    for rank_obs in obs:
        for o in rank_obs:
            for sync in o["syncs"]:
                for mode in ("colocate", "server"):
                    said = " ".join(sync[mode])
                    assert said.startswith("raised UnsupportedModelError") and "inside an FSDP1" in said, said
