"""Models bigger than one device: layerwise generation and the memory budget."""

from __future__ import annotations

from typing import Any

import pytest

from tests import scenarios_scale as ss

LAYERWISE_CASES = [("fsdp", "fp32"), ("fsdp", "bf16"), ("fsdp2", "fp32"), ("fsdp2", "bf16"),
                   ("zero3", "fp32"), ("zero3", "bf16"), ("fsdp2>peft", "bf16")]


def _check_layerwise(obs: dict[str, Any], label: str, precision: str) -> None:
    assert "error" not in obs, f"{label}: {obs['error']}"
    assert obs["training_inside"] is False
    assert obs["logits_diff"] == 0.0 and obs["same_tokens"], f"{label}: layerwise decodes differently: {obs}"
    assert obs["same_state"], f"{label}: parameters, hooks, modes or flags changed"
    assert obs["own_diff"] == 0.0, f"{label}: the backend's own forward changed after layerwise"
    # Rank r asked for 3 + 3r new tokens and got them: the ranks that finished first kept
    # stepping (every forward is collective) instead of leaving the others hanging.
    assert obs["ragged"] == [2, 6 + 3 + 3 * obs["rank"]], obs
    units = sorted(ss.unit_bytes(precision), reverse=True)
    bound = obs["rest_bytes"] + units[0] + units[1]
    assert obs["peak_bytes"] <= bound, f"{label}: peak {obs['peak_bytes']} over shard + two units ({bound})"
    assert obs["peak_bytes"] < obs["rest_bytes"] + obs["full_bytes"], f"{label}: layerwise gathered everything"


@pytest.mark.parametrize(("spec", "precision"), LAYERWISE_CASES)
def test_layerwise_equals_full_within_two_units(group: Any, spec: str, precision: str) -> None:
    for obs in group.run(ss.layerwise, spec, precision, timeout=180):
        _check_layerwise(obs, f"{spec} {precision}", precision)


@pytest.mark.parametrize(("spec", "topology"), [("fsdp", "hsdp"), ("fsdp2", "hsdp"), ("fsdp2", "submesh")])
def test_layerwise_on_multi_node_layouts(group4: Any, spec: str, topology: str) -> None:
    for obs in group4.run(ss.layerwise, spec, "fp32", topology, timeout=180):
        _check_layerwise(obs, f"{spec} {topology}", "fp32")


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3"])
def test_auto_follows_the_memory_budget(group: Any, spec: str) -> None:
    backend = "deepspeed" if spec == "zero3" else spec
    roomy = group.run(ss.auto_choice, spec, None, timeout=180)
    tight = group.run(ss.auto_choice, spec, "10KB", timeout=180)
    for obs in roomy:
        # Enough memory: the whole model is gathered inside, and gathered() is allowed.
        assert obs["chosen"] == [f"generation(gather='auto') on {backend}: full"], obs["chosen"]
        assert obs["gathered"] == obs["full"] == "entered", obs
    for obs in tight:
        [line] = obs["chosen"]
        assert line.startswith(f"generation(gather='auto') on {backend}: layerwise (the gathered model takes"), line
        for key in ("gathered", "full"):
            assert "does not fit" in obs[key] and "gather='layerwise'" in obs[key], obs[key]
    for obs in roomy + tight:
        assert obs["same_tokens"] and obs["training"] is True
        assert "unknown mode" in obs["bad"] and "'layerwise'" in obs["bad"], obs["bad"]
