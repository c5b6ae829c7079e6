"""Weights to an SGLang server in another process (``wrapkit.integrations.sglang``), against the stand-in of
``tests/engines/sglang_standin.py``: the same routes, session rule, group and ``flattened_bucket`` receive as SGLang
0.5.23, over gloo."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import scenarios_engines as se
from tests.harness import _matrix as matrix
from tests.harness.standin_http import Standin, running
from wrapkit.cli._workers import free_port
from wrapkit.integrations.sglang import flattened_bucket

STANDIN = Path(__file__).with_name("sglang_standin.py")


@pytest.fixture(scope="session")
def server() -> Iterator[Standin]:
    with running(Standin(STANDIN)) as s:
        yield s


# ZeRO-3 and FSDP2 gathered, DDP in bf16 (whole parameters, the wire in the model's dtype), LoRA merged on the
# way, a tied model, a mixture of experts (per expert, the Hub's layout), a vision-language and a reward model.
CASES = [{"spec": "fsdp2", "family": "llama"}, {"spec": "ddp", "family": "llama", "precision": "bf16"},
         {"spec": "fsdp2", "family": "llama", "merge": True}, {"spec": "zero3", "family": "qwen2-tied"},
         {"spec": "fsdp2", "family": "qwen3-moe"}, {"spec": "zero3", "family": "qwen2-vl"},
         {"spec": "fsdp2", "family": "llama-reward"}]
# ZeRO-3's gathers (the tied Qwen2's case takes them), FSDP1, ZeRO-2 and tensor parallelism.
LONG_CASES = [{"spec": "zero3", "family": "llama"}, {"spec": "fsdp", "family": "llama"},
              {"spec": "zero2", "family": "llama"}, {"spec": "tp", "family": "llama"}]


def _check(per_rank: list[Any]) -> None:
    reports = [[sync["report"] for sync in syncs] for syncs in per_rank]
    assert reports[0] == [{**r, "seconds": reports[0][i]["seconds"]} for i, r in enumerate(reports[1])]  # agreed
    for sync in per_rank[0]:
        report = sync["report"]
        assert report["tensors"] > 0 and report["buckets"] > 1 and report["bytes"] > 0, report
        assert report["verified"], report  # the engine echoed sent values back
        assert sync["compared"] > 0 and sync["wrong"] == [], sync["wrong"][:5]
        # One session per sync: paused, begun, one update per bucket, ended, checked, continued.
        calls = sync["calls"]
        session = calls[len(calls) - 1 - calls[::-1].index("pause_generation"):]
        # Names asked back: those echoed are ``verified``; a Hub name the engine's model holds under another
        # name (fused experts, a vision-language model's prefixes) is asked and not echoed.
        asked = session.count("get_weights_by_name")
        assert asked >= len(report["verified"]), session
        assert session == ["pause_generation", "begin_weight_update",
                           *["update_weights_from_distributed"] * report["buckets"], "end_weight_update",
                           *["get_weights_by_name"] * asked, "continue_generation", "standin_dump"], session
    assert per_rank[0][0]["calls"][0] == "init_weights_update_group"


@matrix.cases(CASES, LONG_CASES)
def test_sync_to_sglang_equals_the_model(request: pytest.FixtureRequest, group: Any, server: Standin, tmp_path: Path,
                                         case: dict[str, Any]) -> None:
    function = request.node.function
    stash = request.session.stash.setdefault(_OUT, {})
    if not stash:  # every selected case in one call, one family after the other (the server holds one model)
        selected = [item.callspec.params["case"] for item in request.session.items
                    if getattr(item, "function", None) is function]
        for family in dict.fromkeys(c["family"] for c in selected):
            mine = [c for c in selected if c["family"] == family]
            try:
                server.mode(family)
                per_rank = group.run(se.sync_to_standin, mine, server.url, [free_port() for _ in mine],
                                     str(tmp_path), timeout=240)
                stash.update({matrix.key(c): [obs[matrix.key(c)] for obs in per_rank] for c in mine})
            except Exception as exc:  # each case of the family fails with it
                stash.update({matrix.key(c): exc for c in mine})
    outcome = stash[matrix.key(case)]
    if isinstance(outcome, Exception):
        raise outcome
    _check(outcome)


_OUT = pytest.StashKey[dict[str, Any]]()


@pytest.mark.parametrize("refuse, skip, said, then", [
    ("begin_weight_update", None, "begin_weight_update refused by the stand-in", "EngineError"),
    # Refused before its part of the broadcast: the group is out of step, so every rank leaves it.
    ("update_weights_from_distributed", None, "update_weights_from_distributed refused by the stand-in",
     "ArgumentError: SGLangEngine.sync() before connect()"),
    ("init_weights_update_group", None, "init_weights_update_group refused by the stand-in",
     "ArgumentError: SGLangEngine.sync() before connect()"),
    (None, "lm_head", "holds other values for lm_head.weight", "EngineError"),  # success answered, nothing loaded
])
def test_an_engine_that_refuses_fails_every_rank(group: Any, server: Standin, refuse: str | None, skip: str | None,
                                                 said: str, then: str) -> None:
    server.mode(refuse=refuse, skip=skip)
    outcomes, seconds = se.failed_syncs(group, server.url)
    assert all(first.startswith("EngineError") and said in first for first, _ in outcomes), outcomes
    assert all(second.startswith(then) for _, second in outcomes), outcomes  # alike on every rank, no hang
    assert seconds < 60


def test_an_engine_that_dies_mid_update_fails_every_rank(group: Any) -> None:
    with running(Standin(STANDIN).mode(exit_after=1)) as dying:  # exits as its second bucket is sent
        outcomes, seconds = se.failed_syncs(group, dying.url)
    assert all(first.startswith("EngineError") for first, _ in outcomes), outcomes
    assert all(first == outcomes[0][0] for first, _ in outcomes), outcomes  # alike on every rank
    assert seconds < 60  # within the engine's timeout (5 s) and the group's, not for ever


def test_an_engine_that_is_gone_fails_every_rank_at_once(group: Any) -> None:
    outcomes, seconds = se.failed_syncs(group, f"http://127.0.0.1:{free_port()}", connect_only=True)
    # Refused at once: the message says so and the time it took, not the timeout it did not wait for.
    assert all(e.startswith("EngineError") and re.search(r"failed after [0-4]\.\d s .*Connection refused", e)
               for [e] in outcomes), outcomes
    assert seconds < 15  # reported at once, not after the group's timeout


def test_flattened_bucket_orders_by_itemsize_without_padding() -> None:
    from wrapkit import Bucket, BucketEntry

    a = torch.arange(3, dtype=torch.bfloat16)
    b = torch.arange(5, dtype=torch.float32)
    flat = torch.zeros(256, dtype=torch.uint8)
    flat[0:6].copy_(a.view(torch.uint8))
    flat[64:84].copy_(b.view(torch.uint8))
    out, names, dtypes, shapes = flattened_bucket(Bucket(flat, [BucketEntry("a", (3,), torch.bfloat16, 0),
                                                                BucketEntry("b", (5,), torch.float32, 64)]))
    assert names == ["b", "a"] and dtypes == ["float32", "bfloat16"] and shapes == [[5], [3]]
    assert out.numel() == 26  # back to back: no 64-byte slots
    assert torch.equal(out[:20].view(torch.float32), b) and torch.equal(out[20:].view(torch.bfloat16), a)


def test_probes_leave_out_tensors_that_sglang_would_list_whole() -> None:
    from wrapkit.integrations.sglang import PROBE_ELEMENTS, _probes

    embed = torch.zeros(PROBE_ELEMENTS // 64 + 1, 64)  # one row over: SGLang would turn all of it into a list
    norm, proj = torch.ones(64), torch.arange(64 * 8.0).view(8, 64)
    views = {"embed": embed, "norm": norm, "proj": proj}
    assert list(_probes(views, ["embed", "proj", "norm"])) == ["norm"]  # the last; the first is too large
    assert list(_probes(views, ["proj", "norm"])) == ["proj", "norm"]
    only = _probes({"embed": embed, "proj": proj, "big": embed}, ["embed", "proj", "big"])
    assert list(only) == ["proj"] and torch.equal(only["proj"], proj[:1])  # neither end fits: the smallest
    assert _probes({"embed": embed}, ["embed"]) == {}
