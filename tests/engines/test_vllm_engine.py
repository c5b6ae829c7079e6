"""Full weights to a vLLM server in another process (``VLLMEngine.connect`` / ``sync``), against the stand-in of
``tests/engines/vllm_server_standin.py``: vLLM 0.33's weight-transfer routes, session rule and packed receive, over
gloo."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import scenarios_engines as se
from tests.harness import _matrix as matrix
from tests.harness.standin_http import Standin, running
from wrapkit.cli._workers import free_port

STANDIN = Path(__file__).with_name("vllm_server_standin.py")


@pytest.fixture(scope="module")
def server() -> Iterator[Standin]:
    with running(Standin(STANDIN)) as s:
        yield s


# Gathered (FSDP2; ZeRO-3 on a tied model), whole (DDP in bf16), LoRA merged on the way, experts per expert
# (Qwen3-MoE on FSDP1), transformers' pipeline stages funnelled to the sender, tensor parallelism; FSDP1 and
# ZeRO-2 on a dense model, a vision-language and a reward model, and experts split over the ranks, in the long
# selection.
CASES = [{"spec": "fsdp2", "family": "llama"}, {"spec": "ddp", "family": "llama", "precision": "bf16", "merge": True},
         {"spec": "zero3", "family": "qwen2-tied"}, {"spec": "fsdp", "family": "qwen3-moe"},
         {"spec": "split", "split": "pipeline", "family": "llama"}, {"spec": "tp", "family": "llama"}]
LONG_CASES = [{"spec": "fsdp", "family": "llama"}, {"spec": "zero2", "family": "llama"},
              {"spec": "fsdp2", "family": "qwen2-vl"}, {"spec": "zero3", "family": "llama-reward"},
              {"spec": "split", "split": "experts", "family": "qwen3-moe"}]
FOUR_RANK_CASES = [{"spec": "fsdp2", "family": "llama", "topology": "hsdp"}]


def _check(per_rank: list[Any]) -> None:
    reports = [[sync["report"] for sync in syncs] for syncs in per_rank]
    for other in reports[1:]:  # agreed: the same report on every rank
        assert reports[0] == [{**r, "seconds": reports[0][i]["seconds"]} for i, r in enumerate(other)]
    versions = set()
    for sync in per_rank[0]:
        report = sync["report"]
        assert report["tensors"] > 0 and report["buckets"] > 1 and report["bytes"] > 0, report
        assert sync["compared"] > 0 and sync["wrong"] == [], sync["wrong"][:5]
        versions.add(report["version"])
        # One session per sync: paused, started, one update (every chunk), finished, version read back, resumed.
        calls = sync["calls"]
        assert calls[len(calls) - 1 - calls[::-1].index("pause"):] == [
            "pause", "start_weight_update", "update_weights", "finish_weight_update", "weight_info",
            "reset_prefix_cache", "resume", "standin_dump"], calls
    assert per_rank[0][0]["calls"][:2] == ["version", "init_weight_transfer_engine"]
    assert len(versions) == len(per_rank[0]) and None not in versions  # a version of its own per sync


def _run(group: Any, server: Standin, tmp_path: Path, cases: list[dict[str, Any]]) -> list[Any]:
    server.mode(cases[0]["family"])
    return group.run(se.sync_to_standin, cases, server.url, [free_port() for _ in cases], str(tmp_path), "vllm",
                     timeout=240)


@matrix.cases(CASES, LONG_CASES)
def test_sync_to_vllm_equals_the_model(group: Any, server: Standin, tmp_path: Path, case: dict[str, Any]) -> None:
    per_rank = _run(group, server, tmp_path, [case])
    _check([obs[matrix.key(case)] for obs in per_rank])


@matrix.cases(FOUR_RANK_CASES, [])
def test_sync_to_vllm_on_four_ranks(group4: Any, server: Standin, tmp_path: Path, case: dict[str, Any]) -> None:
    per_rank = _run(group4, server, tmp_path, [case])
    _check([obs[matrix.key(case)] for obs in per_rank])


@pytest.mark.parametrize("behaviour, said, then", [
    ({"refuse": "start_weight_update"}, "start_weight_update was refused: HTTP 500: Call to collective_rpc",
     "EngineError"),
    # Refused before it received anything: the sender's chunks find no receiver, so every rank drops the group.
    ({"refuse": "update_weights"}, "update_weights was refused: HTTP 500", "ArgumentError: VLLMEngine.sync() before"),
    ({"refuse": "init_weight_transfer_engine"}, "init_weight_transfer_engine was refused",
     "ArgumentError: VLLMEngine.sync() before"),
    # Success answered, but the update never finished under this sync's version.
    ({"forget_version": True}, "reports weight version None", "EngineError"),
    # An older server, whose wire was not checked: refused before anything is joined (0.32 is taken: a real one
    # runs in the vLLM stage, tests/vllm).
    ({"release": "0.31.2"}, "the server runs vLLM 0.31.2", "ArgumentError: VLLMEngine.sync() before"),
    # Metadata the server's model does not know: the load fails after the chunks arrived; the group stays usable.
    ({"family": "qwen3-moe"}, "update_weights was refused: HTTP 500: Call to collective_rpc", "EngineError"),
])
def test_a_vllm_server_that_refuses_fails_every_rank(group: Any, server: Standin, behaviour: dict[str, Any],
                                                     said: str, then: str) -> None:
    server.mode(**behaviour)
    outcomes, seconds = se.failed_syncs(group, server.url, "vllm")
    assert all(first.startswith("EngineError") and said in first for first, _ in outcomes), outcomes
    assert all(second.startswith(then) for _, second in outcomes), outcomes  # alike on every rank, no hang
    assert seconds < 60


def test_a_vllm_server_that_dies_mid_update_fails_every_rank(group: Any) -> None:
    with running(Standin(STANDIN).mode(exit_after=1)) as dying:  # exits as its second chunk arrives
        outcomes, seconds = se.failed_syncs(group, dying.url, "vllm")
    assert all(first.startswith("EngineError") for first, _ in outcomes), outcomes
    assert all(first == outcomes[0][0] for first, _ in outcomes), outcomes  # alike on every rank
    assert seconds < 60  # within the engine's timeout (5 s) and the wire's, not for ever


def test_a_vllm_server_that_is_gone_fails_every_rank_at_once(group: Any) -> None:
    outcomes, seconds = se.failed_syncs(group, f"http://127.0.0.1:{free_port()}", "vllm", connect_only=True)
    # Refused at once: the message says so and the time it took, not the timeout it did not wait for.
    assert all(e.startswith("EngineError") and re.search(r"failed after [0-4]\.\d s .*Connection refused", e)
               for [e] in outcomes), outcomes
    assert seconds < 15  # reported at once, not after the group's timeout


@pytest.mark.parametrize("spec", ["fsdp2", "ddp", "fsdp", matrix.long("zero3", id="zero3")])
def test_a_vllm_refusal_mid_update_is_raised_at_once_with_its_reason(group: Any, server: Standin, spec: str) -> None:
    """The worker refuses the first, a middle or the last chunk: every rank raises the server's reason within a
    second of its answer, not after the wire's timeout (8 s); where chunks were left unsent the group is dropped on
    every rank, and a connect() again on the same port serves a sync."""
    ports = [free_port() for _ in range(3)]
    per_rank = group.run(se.vllm_refused_mid_update, spec, server.url, ports, [0, "middle", -1], timeout=180)
    for i, at in enumerate([0, "middle", -1]):
        refused_at = per_rank[0]["refusals"][i]["refused_at"]
        assert refused_at is not None  # the stand-in did refuse this chunk
        for obs in per_rank:
            got = obs["refusals"][i]
            assert got["first"].startswith("EngineError") and "update_weights was refused: HTTP 500" in got["first"]
            if at == 0:  # refused with a bare assertion, whose reason vLLM passes on as '': where it is, and what
                # the workers were loading (the first chunk's tensors)
                assert "vLLM passed on no reason" in got["first"] and "server's log" in got["first"], got
                assert "were loading the last chunk sent: model.embed_tokens.weight" in got["first"], got
            else:
                assert "the stand-in's worker refused chunk" in got["first"], got  # the server's own reason
            assert got["raised_at"] - refused_at < 1.0, (at, got["raised_at"] - refused_at)
            # Chunks left unsent: out of step, dropped on every rank. The last chunk arrived: the group stays.
            then = "EngineError" if at == -1 else "ArgumentError: VLLMEngine.sync() before connect()"
            assert got["second"].startswith(then), got
    assert all(obs["after"] == "no error" for obs in per_rank), [obs["after"] for obs in per_rank]


def test_the_gloo_plugin_cuts_chunks_as_the_sender_does() -> None:
    """wrapkit's vLLM plugin receives the chunks vLLM's packed producer cuts (one closed right after the tensor that
    takes it past the buffer), and, unpacked, one per tensor, an empty tensor included."""
    from wrapkit.integrations.engines.vllm_gloo import _chunks

    meta = [("a", "float32", [4]), ("b", "float32", [0]), ("c", "bfloat16", [8]), ("d", "float32", [2])]
    assert [[p[0] for p in c] for c in _chunks(meta, 16)] == [["a", "b", "c"], ["d"]]
    assert [[p[0] for p in c] for c in _chunks(meta, 64)] == [["a", "b", "c", "d"]]
    assert [[p[0] for p in c] for c in _chunks(meta, None)] == [["a"], ["b"], ["c"], ["d"]]
    assert [p[3] for c in _chunks(meta, None) for p in c] == [16, 0, 16, 8]


def test_a_peft_model_sent_unmerged_to_vllm_is_refused_before_anything_is_sent() -> None:
    """Unmerged, a PEFT model's stream is under PEFT's names, which no model vLLM serves has (the real server's
    loader refuses ``base_model.model.*`` mid-update): refused up front, naming the fix, with no server touched."""
    import wrapkit
    from wrapkit.cli._models import build
    from wrapkit.integrations.vllm import VLLMEngine

    engine = VLLMEngine("http://127.0.0.1:9", backend="gloo", master_port=29999, timeout=1)
    with pytest.raises(wrapkit.ArgumentError, match=r"merge_adapters=True .* sync_adapters\(\)"):
        engine.sync(wrapkit.adapt(build("peft")))


def test_sparse_patches_before_connect_are_refused() -> None:
    """``VLLMEngine.send_patches`` (a ``DeltaSync`` round for wrapkit's ``sparse_gloo`` backend) needs the group
    ``connect()`` joins: before it, an error naming the fix, with no server touched."""
    import wrapkit
    from wrapkit.integrations.vllm import VLLMEngine

    engine = VLLMEngine("http://127.0.0.1:9", backend="gloo", master_port=29999, timeout=1)
    with pytest.raises(wrapkit.ArgumentError, match=r"before connect\(\)"):
        engine.send_patches([])
