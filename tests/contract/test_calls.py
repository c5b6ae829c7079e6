"""Mismatched collective calls end in an error on every rank within seconds, nothing changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.contract import scenarios_calls
from tests.harness._matrix import long

SPECS = ["ddp", "fsdp", "fsdp2", "zero3", "tp"]


def _op(label: str) -> str:
    return label.split("(")[0].removeprefix("ref.")


def _check(results: list[Any], spec: str) -> None:
    names = list(scenarios_calls.OPS)
    for obs in results:
        assert obs["changed"] == [], f"{spec}: changed by a mismatched call: {obs['changed']}"
        assert obs["files"] is True, f"{spec}: a mismatched call left files behind: {obs['files']}"
        assert obs["after"] == "ok"
        for (a, b) in zip(names, names[1:] + names[:1], strict=True):
            got = obs[f"{a} / {b}"]
            assert got["error"].startswith("DistributedStateError"), (spec, a, b, got)
            # Named on every rank: what each rank called.
            assert f": {_op(a)}(" in got["error"] and f": {_op(b)}(" in got["error"], got
            assert got["seconds"] < 10, (spec, a, b, got)
        for arg in scenarios_calls.ARGS:
            got = obs[f"{arg} differs"]
            assert got["error"].startswith("DistributedStateError"), (spec, arg, got)
            assert arg in got["error"] or arg == "device", (spec, arg, got)
        assert obs["unchecked"] == "no error", obs["unchecked"]


@pytest.mark.parametrize("spec", SPECS)
def test_mismatched_calls_are_caught(group: Any, spec: str, tmp_path: Path) -> None:
    _check(group.run(scenarios_calls.mismatched_calls, spec, str(tmp_path), timeout=240), spec)


@pytest.mark.parametrize("spec", ["fsdp2", "zero3"])
def test_mismatched_calls_are_caught_in_bf16(group: Any, spec: str, tmp_path: Path) -> None:
    _check(group.run(scenarios_calls.mismatched_calls, spec, str(tmp_path), "bf16", timeout=240), spec)


# HSDP and ZeRO-3's sub-groups by default; the other four-rank layouts are long.
@pytest.mark.parametrize("spec, topology", [
    ("fsdp2", "hsdp"), ("zero3", "subgroup"),
    *(long(s, t) for s, t in [("fsdp", "hybrid-groups"), ("fsdp2", "submesh"), ("ddp", "subgroup"), ("fsdp2", "tp")])])
def test_mismatched_calls_are_caught_on_four_ranks(group4: Any, spec: str, topology: str, tmp_path: Path) -> None:
    _check(group4.run(scenarios_calls.mismatched_calls, spec, str(tmp_path), "fp32", topology, timeout=300),
           f"{spec} {topology}")


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3"])
def test_missing_backend_internals_are_refused_on_adapt(group: Any, spec: str) -> None:
    package = "deepspeed" if spec == "zero3" else "torch"
    missing = {"fsdp": "_shard_param_infos", "fsdp2": "_local_tensor", "zero3": "ds_status"}[spec]
    for text in group.run(scenarios_calls.missing_internals, spec, timeout=120):
        assert text.startswith("UnsupportedModelError"), text
        assert f"this {package} " in text and missing in text and "install a" in text, text


def test_an_operation_called_on_one_rank_fails_within_the_entry_timeout(tmp_path: Path) -> None:
    from tests.harness.launch import ROOT, torchrun

    report = tmp_path / "one_rank.json"
    torchrun(ROOT / "tests" / "harness" / "one_rank_run.py", str(report), timeout=120, WRAPKIT_ENTRY_TIMEOUT="2")
    obs = json.loads(report.read_text())
    error = obs["error"]
    assert error.startswith("DistributedStateError"), error
    assert "full_state_dict(" in error and "WRAPKIT_ENTRY_TIMEOUT" in error and "some ranks only" in error, error
    assert 1.8 <= obs["seconds"] < 20, obs
