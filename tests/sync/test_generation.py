"""``gathered()``, ``generation()`` and ``named_full_parameters()`` on every backend (two gloo ranks)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.harness._matrix import long
from tests.sync import scenarios_generation as sg
from wrapkit.cli._models import build, parse_stack

FULL_SPECS = [
    "plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3",
    "zero3>peft", "fsdp2>peft", "ddp>compile>peft", "compile>peft",
    # Compile's prefix under a wrapper is ddp>compile>peft's case; inside FSDP1 it costs 9 s of tracing (its
    # generation runs by default, below).
    long("fsdp>compile"),
]
SHARDED = {"fsdp", "fsdp2", "zero3"}
MODIFIER_SPECS = ["plain", "dp", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3>peft", "fsdp2>peft"]
GENERATION_SPECS = ["plain", "ddp", "fsdp", "fsdp2", "zero2", "zero3", "zero3>peft", "fsdp2>peft", "fsdp>compile"]

_expected_names: dict[bool, list[str]] = {}


def expected_names(spec: str) -> list[str]:
    """Parameter keys of the unwrapped model's own state_dict (PEFT kept), computed without any backend."""
    peft = "peft" in parse_stack(spec)
    if peft not in _expected_names:
        model = build("peft" if peft else "plain")
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        _expected_names[peft] = sorted(k for k in model.state_dict() if k in params)
    return _expected_names[peft]


@pytest.mark.parametrize("spec", FULL_SPECS)
def test_named_full_parameters_and_gathered(group: Any, spec: str) -> None:
    for obs in group.run(sg.full_parameters, spec, timeout=120):
        # The same names on every backend: the unwrapped model's own state_dict keys.
        assert obs["names"] == expected_names(spec) == obs["ref_state_dict_keys"], spec
        assert obs["shapes_ok"] and obs["max_diff"] == 0.0, f"{spec}: full values differ from the model's"
        assert obs["gathered_names"] == obs["names"], f"{spec}: gathered() module names are not canonical"
        assert obs["gathered_max_diff"] == 0.0
        assert obs["gathered_forward_diff"] < 1e-5, f"{spec}: forward inside gathered() differs"
        assert obs["forward_after_diff"] < 1e-5, f"{spec}: the wrapped model changed after gathered()"


@pytest.mark.parametrize("spec", MODIFIER_SPECS)
def test_modifier_rank(group: Any, spec: str) -> None:
    name = "base_model.model.lm_head.weight" if "peft" in spec else "lm_head.weight"
    backend = parse_stack(spec)[0]
    for rank, obs in enumerate(group.run(sg.modifier_rank, spec, name, timeout=120)):
        # Written on the modifier rank only, seen everywhere (both ends of the tensor: both shards).
        assert obs["after_modifier"] == (5.0, 5.0), f"{spec} rank {rank}: {obs}"
        assert obs["inside_none"] == 7.0
        if backend in SHARDED:
            assert obs["after_none"] == (5.0, 5.0), f"{spec}: write without modifier_rank persisted"
        # A body failing on one rank only: every rank discards every write.
        assert obs["after_failure"] == obs["before_failure"], f"{spec} rank {rank}: {obs}"
        # The writer is the last rank of the model's group (rank 0 of a 1-rank plain/dp model).
        assert obs["raised"] is (obs["world"] == 1 or rank == obs["world"] - 1)
        assert obs["bad_rank_error"] == "DistributedStateError"


@pytest.mark.parametrize("spec", GENERATION_SPECS)
def test_generation(group: Any, spec: str) -> None:
    for obs in group.run(sg.generation, spec, timeout=180):
        assert obs["same_tokens"], f"{spec}: greedy tokens differ from the unsharded model"
        assert obs["inside"] == {"training": 0, "checkpointing": False, "fsdp_managed": False}, obs["inside"]
        # The flag is there outside (so the check above means something) wherever FSDP wraps the model.
        assert obs["managed_outside"] == spec.split(">")[0].startswith("fsdp"), spec
        assert obs["after_equal"], f"{spec}: state changed by generation()"
        assert obs["after_error_equal"], f"{spec}: state changed by a failing generation(): {obs['diff']}"
        assert obs["after_gathered_error_equal"], f"{spec}: state changed by a failing gathered()"


@pytest.mark.parametrize("spec", ["zero3", "fsdp", "fsdp2"])
def test_failure_4_generation_between_training_steps(group: Any, spec: str) -> None:
    # Each training step asserts that every module is in training mode at backward.
    for obs in group.run(sg.alternate, spec, timeout=180):
        assert obs["True"] == obs["False"], f"{spec}: generation in between changed the losses"


@pytest.mark.parametrize("spec", ["zero3", "fsdp"])
def test_failure_4_raw_approach_leaves_eval_mode(group: Any, spec: str) -> None:
    # The same objects, generated on the raw way: the model is left in eval mode for the next backward.
    for left_in_eval in group.run(sg.raw_eval_then_train, spec, timeout=120):
        assert "LlamaForCausalLM" in left_in_eval


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["ddp", "fsdp", "fsdp2", "zero3"])
def test_generation_gpu(gpu_group: Any, spec: str) -> None:
    # NCCL ranks on CUDA: the flags agreed across ranks and every gathered tensor live on the GPU.
    if spec.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in gpu_group.run(sg.generation, spec, "cuda", timeout=300):
        assert obs["same_tokens"], f"{spec}: greedy tokens differ from the unsharded model"
        assert obs["after_equal"] and obs["after_error_equal"] and obs["after_gathered_error_equal"], obs["diff"]



@pytest.mark.parametrize("backend", ["fsdp", "fsdp2"])
def test_uneven_shards(group: Any, backend: str) -> None:
    # Shards of unequal size (and empty ones): gathering and writing back must still be exact.
    for obs in group.run(sg.uneven, backend, timeout=60):
        assert obs == {"full_equal": True, "gathered_equal": True, "written_equal": True}, f"{backend}: {obs}"


def test_generation_with_registered_generate(group: Any) -> None:
    for obs in group.run(sg.generation_registered_generate, "fsdp2", timeout=180):
        assert obs["registered"] and obs["wrapper_back"]
        assert obs["same_tokens"] and obs["after_equal"]
        assert math.isfinite(obs["loss_after"])  # the model still trains


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "ddp"])
def test_torch_ops_beside_a_zero3_engine(group: Any, spec: str) -> None:
    pytest.importorskip("deepspeed")
    for obs in group.run(sg.torch_ops, spec, timeout=120):
        assert obs["replaced"] and obs["reported"] == ["torch.nn.functional.linear"], obs
        # wrapkit's contexts and the reference it builds run with torch's own linear ...
        assert obs["generation"] == [True] and obs["gathered"] == [True] and obs["reference"] == [True], obs
        # ... and put DeepSpeed's back, which the engine's own forward keeps using.
        assert obs["after_generation"] and obs["after_reference"] and obs["after_all"], obs
        assert obs["engine"] == [False], obs
