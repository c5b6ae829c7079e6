"""place(), to_eval_frozen() and prepare_reference() on every backend, with the regression
tests for failures #2 (a None reference handed to deepspeed.initialize) and #3 (a reference
left unwrapped on the wrong device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.references import scenarios_reference as sc

LOCAL = ["plain", "dp"]
DISTRIBUTED = ["ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
SHARDED = {"fsdp", "fsdp2", "zero3"}


def _backend(spec: str) -> str:
    first = spec.split(">")[0]
    return "deepspeed" if first.startswith("zero") else first


def _runs(group: Any, fn: Any, *args: Any, local: bool = False, timeout: float = 180, **kw: Any) -> list[Any]:
    return [fn(*args, **kw)] if local else group.run(fn, *args, timeout=timeout, **kw)


# -- place() ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LOCAL + DISTRIBUTED)
def test_place_round_trip_keeps_bits_and_training(request: pytest.FixtureRequest, spec: str) -> None:
    group = None if spec in LOCAL else request.getfixturevalue("group")
    for obs in _runs(group, sc.place_round_trip, spec, local=spec in LOCAL):
        assert obs["returned_self"]
        assert obs["offloaded_devices"] == ["cpu"] and obs["home_devices"] == [obs["compute_device"]]
        if spec not in ("zero1", "zero2", "zero3"):
            # Fresh storage everywhere: the move really happened (ZeRO-1/2/3 offload is a no-op cpu->cpu).
            assert obs["storages_changed"] == obs["storages"] > 0
        assert obs["bitwise_equal"]
        assert obs["losses"] == obs["twin_losses"], f"{spec}: training diverged after the round trip"
        assert obs["losses"][3] != obs["losses"][0]  # and it did train


def test_place_names_what_cannot_move() -> None:
    msg = sc.placement_error()
    assert msg.startswith("moving the plain model's parameters to cpu failed")
    assert "model.layers.1.mlp.down_proj.weight" in msg


# -- to_eval_frozen() ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LOCAL + DISTRIBUTED + ["fsdp2>peft", "ddp>compile>peft"])
def test_to_eval_frozen(request: pytest.FixtureRequest, spec: str) -> None:
    local = spec in LOCAL
    group = None if local else request.getfixturevalue("group")
    backend = _backend(spec)
    for obs in _runs(group, sc.to_eval_frozen, spec, local=local):
        assert obs["is_protocol"] and obs["idempotent"]
        assert obs["backend"] == ("plain" if backend in ("dp", "ddp") else backend)
        assert obs["is_sharded"] == (spec.split(">")[0] in SHARDED)
        assert obs["training_modules"] == 0 and obs["trainable_parameters"] == 0
        assert obs["devices"] == [obs["compute_device"]]
        assert not obs["output_requires_grad"]
        assert obs["forward_max_diff"] < 1e-4


# -- prepare_reference() ------------------------------------------------------------------------
CASES = [
    # spec, ref given, expected reference backend
    ("plain", False, "plain"), ("dp", False, "plain"), ("ddp", False, "plain"), ("fsdp", False, "fsdp"),
    ("fsdp2", False, "fsdp2"), ("zero0", False, "plain"), ("zero1", False, "plain"), ("zero2", False, "plain"),
    ("zero3", False, "deepspeed"), ("ddp>peft", False, "ddp"), ("fsdp2>peft", False, "fsdp2"),
    ("zero3>peft", False, "deepspeed"), ("zero3", True, "deepspeed"), ("fsdp", True, "fsdp"),
    ("fsdp2", True, "fsdp2"), ("ddp", True, "plain"), ("zero2", True, "plain"),
]


@pytest.mark.parametrize(("spec", "with_ref", "backend"), CASES, ids=[f"{c[0]}-{'ref' if c[1] else 'none'}"
                                                                       for c in CASES])
def test_prepare_reference(request: pytest.FixtureRequest, spec: str, with_ref: bool, backend: str) -> None:
    local = spec in LOCAL
    group = None if local else request.getfixturevalue("group")
    for obs in _runs(group, sc.prepare_reference, spec, with_ref, local=local):
        assert obs["is_protocol"] and obs["backend"] == backend
        view = "peft" in spec and not with_ref
        assert obs["stack"][0] == ("adapters-off" if view else obs["stack"][0])
        assert obs["is_sharded"] == (spec.split(">")[0] in SHARDED)
        if backend == "deepspeed":
            assert obs["zero_stage"] == 3
        assert obs["training_modules"] == 0 and obs["trainable_parameters"] == 0
        # Failure #3: every parameter/shard of the reference is on the policy's compute device.
        assert obs["ref_device"] == obs["policy_device"] and obs["devices"] == [obs["policy_device"]]
        assert obs["num_parameters"] == obs["base_parameters"]
        assert obs["dtypes"] == ["torch.float32"]
        assert obs["max_diff"] < 1e-5, f"{spec}: reference logits differ from the policy's"
        assert obs["unchanged_after_step"] and obs["policy_moved"] > 0
        assert obs["policy_still_trains"] > 0


@pytest.mark.parametrize("which", ["policy", "inner", "adapter"])
def test_reference_sharing_the_policy_is_refused(group: Any, which: str) -> None:
    for msg in group.run(sc.shared_refused, which, timeout=120):
        assert msg.startswith("ReferenceModelError: ref_model is the policy or shares parameters with it")
        assert "pass a separate model" in msg and "None" in msg


def test_failure2_zero2_peft_none_reference(group: Any) -> None:
    for obs in group.run(sc.failure2_zero2_peft, timeout=180):
        print(f"raw deepspeed.initialize(model=None): {obs['raw']}")
        assert obs["raw"] != "no error", "deepspeed.initialize(model=None) used to fail and should still"
        assert obs["type"] == "AdapterDisabledView"
        assert obs["max_diff"] < 1e-5 and obs["unchanged_after_step"] and obs["policy_moved"] > 0
        assert obs["policy_modes_restored"] is True


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3", "ddp"])
def test_failure3_eval_mode_reference_is_wrapped_and_placed(group: Any, spec: str) -> None:
    for obs in group.run(sc.prepare_reference, spec, True, True, timeout=180):
        assert obs["is_sharded"] == (spec in SHARDED)
        assert obs["devices"] == [obs["policy_device"]] and obs["logits_device"] == obs["policy_device"]
        assert obs["max_diff"] < 1e-5


@pytest.mark.parametrize(("spec", "threshold_zero"), [("zero3", True), ("zero3", False), ("fsdp", False),
                                                      ("fsdp2", False)])
def test_sharded_reference_memory(group: Any, spec: str, threshold_zero: bool) -> None:
    for obs in group.run(sc.resident_bytes, spec, threshold_zero, timeout=180):
        # A shard per parameter (ZeRO-3) or per unit (FSDP1) may be padded by up to world-1 elements.
        padding = 64 * obs["world"] * 4
        print(f"{spec} persistence_threshold0={threshold_zero}: {obs}")
        assert obs["at_rest"] <= obs["full"] / obs["world"] + padding
        # FSDP1 would keep its root unit gathered after a forward: the reference gives the
        # embeddings and head units of their own, so it stays sharded there too.
        assert obs["after_forward"] <= obs["full"] / obs["world"] + obs["persistent"] + padding
        assert obs["policy_resident"] <= obs["full"] / obs["world"] + padding


# -- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3", "ddp"])
def test_failure3_reference_on_cuda(gpu_group: Any, spec: str) -> None:
    if spec.startswith("zero"):
        pytest.importorskip("deepspeed")
    # A fresh copy, and a separate eval-mode reference built on the CPU (how failure #3 began).
    for with_ref in (False, True):
        for obs in gpu_group.run(sc.prepare_reference, spec, with_ref, True, "cuda", "cpu", timeout=300):
            assert obs["policy_device"].startswith("cuda")
            assert obs["devices"] == [obs["policy_device"]] and obs["logits_device"] == obs["policy_device"]
            assert obs["max_diff"] < 1e-4 and obs["unchanged_after_step"]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["ddp", "fsdp", "fsdp2", "zero0", "zero2", "zero3"])
def test_place_round_trip_on_cuda(gpu_group: Any, spec: str) -> None:
    if spec.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in gpu_group.run(sc.place_round_trip, spec, "cuda", timeout=300):
        assert obs["offloaded_devices"] == ["cpu"] and obs["home_devices"] == [obs["compute_device"]]
        assert obs["compute_device"].startswith("cuda")
        assert obs["bitwise_equal"] and obs["losses"] == obs["twin_losses"]


def test_zero3_reference_config(group: Any) -> None:
    for obs in group.run(sc.zero_reference_config, timeout=180):
        assert "optimizer" in obs["policy_keys"] and "optimizer" not in obs["ref_keys"]
        assert "scheduler" not in obs["ref_keys"]
        assert obs["zero"]["stage"] == 3 and obs["zero"]["stage3_max_live_parameters"] == 12345
        assert obs["optimizer"] == "DeepSpeedZeRoOffload"  # parameter management only, nothing to train


def test_zero2_bf16_reference_in_compute_dtype(group: Any) -> None:
    for obs in group.run(sc.bf16_zero2_reference, timeout=180):
        assert obs["backend"] == "plain" and obs["dtypes"] == ["torch.bfloat16"]
        assert obs["max_diff"] < 1e-2


def test_ds_config_needs_a_deepspeed_policy(group: Any) -> None:
    for msg in group.run(sc.ds_config_for_ddp, timeout=120):
        assert msg.startswith("ReferenceModelError: ds_config only applies to a DeepSpeed policy") and "'ddp'" in msg


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3"])
def test_a_fresh_reference_keeps_float32_rotary_tables_of_a_bf16_model(group: Any, tmp_path: Path, spec: str) -> None:
    """Built from a skeleton cast to bf16, the frozen copy had rounded the float32 rotary tables transformers
    keeps beside bf16 weights, and every logit moved (0.004 at most on the tiny Llama)."""
    for obs in group.run(sc.loaded_bf16_reference, spec, str(tmp_path), timeout=180):
        assert "torch.float32" in obs["policy_buffers"].values(), obs["policy_buffers"]
        assert obs["buffers"] == obs["policy_buffers"], obs
        assert obs["diff"] == 0.0, obs


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp"])
def test_a_reference_is_sharded_where_the_policy_is(group: Any, backend: str) -> None:
    """A model without transformers' block list (torchtitan's): the reference takes the policy's own units."""
    for obs in group.run(sc.reference_sharded_like_policy, backend, timeout=120):
        assert obs["reference"] == obs["policy"] and len(obs["policy"]) >= 4, obs
        assert obs["same"]
