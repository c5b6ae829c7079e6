"""LoRA adapters alone to vLLM and SGLang servers in other processes (``VLLMEngine.sync_adapters``,
``SGLangEngine.sync_adapters``), against the stand-in of ``tests/engines/lora_standin.py``: vLLM's load-from-path routes
and SGLang's load-from-tensors route as their released source has them, each adapter loaded into a PEFT model
over a transformers model. Two servers: every data-parallel replica is told."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import scenarios_engines as se
from tests.harness.standin_http import Servers, running
from wrapkit.cli._workers import free_port
from wrapkit.integrations.engines._engine_wire import call

STANDIN = Path(__file__).with_name("lora_standin.py")


class Replicas(Servers):
    """Two stand-in servers, started once for the session; ``mode()`` gives both a fresh base model."""

    def __init__(self) -> None:
        super().__init__(STANDIN, 2)

    def mode(self, engine: str, family: str = "llama", refuse_last: str | None = None) -> Replicas:
        for i, url in enumerate(self.urls):
            refuse = refuse_last if i == len(self.urls) - 1 else None
            req = {"engine": engine, "family": family, "seed": 0, "tp": 2, "refuse": refuse}
            assert call(url, "standin_mode", req, 60)["success"]
        return self


@pytest.fixture(scope="session")
def replicas() -> Iterator[Replicas]:
    with running(Replicas()) as r:
        yield r


# Both engines from sharded backends; tied models; DDP in bf16 (the adapter's tensors in bf16, checked by
# SGLang's per-tensor SHA-256); LoRA on a mixture's fused experts (vLLM is told it is in the 3-D layout);
# pipeline stages; a vision-language model, an encoder-decoder and a reward model.
CASES = [{"engine": "vllm", "spec": "fsdp2", "family": "llama"},
         {"engine": "vllm", "spec": "zero3", "family": "qwen2-tied"},
         {"engine": "vllm", "spec": "fsdp2", "family": "qwen3-moe"},
         {"engine": "sglang", "spec": "fsdp", "family": "llama"},
         {"engine": "sglang", "spec": "ddp", "family": "llama", "precision": "bf16"},
         {"engine": "sglang", "spec": "zero3", "family": "qwen3-moe"},
         {"engine": "sglang", "spec": "pipeline", "family": "llama"},
         {"engine": "vllm", "spec": "fsdp2", "family": "gemma3"},
         {"engine": "sglang", "spec": "zero3", "family": "qwen2-vl"},
         {"engine": "vllm", "spec": "ddp", "family": "t5"},
         {"engine": "sglang", "spec": "fsdp2", "family": "llama-reward"}]
FOUR_RANK_CASES = [{"engine": "vllm", "spec": "fsdp2", "family": "llama", "topology": "hsdp"}]


def _ids(case: dict[str, Any]) -> str:
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_adapter_versions_reach_every_replica(group: Any, replicas: Replicas, tmp_path: Path,
                                              case: dict[str, Any]) -> None:
    _check(case, _run(group, replicas, tmp_path, case))


@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=_ids)
def test_adapter_versions_from_four_rank_layouts(group4: Any, replicas: Replicas, tmp_path: Path,
                                                 case: dict[str, Any]) -> None:
    _check(case, _run(group4, replicas, tmp_path, case))


def _run(group: Any, replicas: Replicas, tmp_path: Path, case: dict[str, Any]) -> list[Any]:
    replicas.mode(case["engine"], case["family"])
    per_rank = group.run(se.adapters_to_standins, [case], replicas.urls, str(tmp_path), timeout=180)
    return [obs[repr(sorted(case.items()))] for obs in per_rank]


def _check(case: dict[str, Any], syncs: list[Any]) -> None:
    reports = [[{**s["report"], "seconds": 0} for s in rank] for rank in syncs]
    assert all(r == reports[0] for r in reports)  # agreed on every rank
    name = f"{case['spec']}-{case['family']}"
    for step, sync in enumerate(syncs[0]):
        report, version = sync["report"], f"{name}-v{step + 1}"
        assert report["name"] == version and report["version"] == step + 1 and report["replicas"] == 2, report
        assert report["tensors"] > 0 and report["bytes"] > 0, report
        assert report["unloaded"] == ([] if step == 0 else [f"{name}-v{step}"]), report  # keep=1
        assert sync["listed"] == [[version], [version]], sync["listed"]  # every replica, the old version gone
        if case["engine"] == "vllm":  # the files of an unloaded version go with it
            assert sync["files"] == [version], sync["files"]
        if "logits_diff" in sync:  # the engine's model with the served adapter computes what the trainer's does
            assert sync["logits_diff"] < 1e-5, sync["logits_diff"]
    assert syncs[0][1]["report"]["tensors"] == syncs[0][0]["report"]["tensors"]


@pytest.mark.parametrize("engine, route", [("vllm", "v1/load_lora_adapter"),
                                           ("sglang", "load_lora_adapter_from_tensors")])
def test_a_replica_that_refuses_leaves_every_replica_as_it_was(group: Any, replicas: Replicas, tmp_path: Path,
                                                               engine: str, route: str) -> None:
    replicas.mode(engine, refuse_last=route)
    outcomes = group.run(se.adapters_refused, engine, replicas.urls, str(tmp_path), timeout=120)
    for rank in outcomes:
        assert len(rank) == 2 and all(o.startswith("EngineError") and "refused by the stand-in" in o
                                      and "unloaded it again" in o for o in rank), rank
    assert outcomes[0] == outcomes[1]
    assert "policy-v1" in outcomes[0][0] and "policy-v2" in outcomes[0][1]  # a refused name is never reused
    for url in replicas.urls:  # the first replica took each version and gave it back
        calls = call(url, "standin_calls", {}, 30)["calls"]
        assert calls.count(route) == 2, calls
    from wrapkit.integrations.engines._adapters import listed

    assert [listed(url, 30) for url in replicas.urls] == [{"base-model"}, {"base-model"}]
    assert list(tmp_path.iterdir()) == []  # no files of a refused version are left


def test_an_engine_that_is_gone_fails_every_rank_at_once(group: Any, tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcomes = group.run(se.adapters_refused, "vllm", [f"http://127.0.0.1:{free_port()}"], str(tmp_path),
                         timeout=120)
    # Refused at once: the message says so and the time it took, not the timeout it did not wait for.
    assert all(o.startswith("EngineError") and re.search(r"failed after [0-4]\.\d s .*Connection refused", o)
               for rank in outcomes for o in rank), outcomes
    assert time.monotonic() - t0 < 30


def test_too_few_copies_for_sglangs_tensor_parallel_ranks_says_so(group: Any, replicas: Replicas,
                                                                  tmp_path: Path) -> None:
    replicas.mode("sglang")  # the stand-ins run two tensor-parallel ranks, each reading its own copy
    outcomes = group.run(se.adapters_refused, "sglang", replicas.urls, str(tmp_path), 1, timeout=120)
    for rank in outcomes:
        assert all(o.startswith("EngineError") and "pass the server's tensor-parallel size as engine_ranks" in o
                   for o in rank), rank
