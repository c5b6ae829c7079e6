"""Models prepared by accelerate, adapted by wrapkit, and wrapkit's TRL drop-ins next to them
(two real gloo ranks). How accelerate's FSDP setups run on a CPU-only machine:
``tests/integrations/accelerate_cpu.py``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations import scenarios_accelerate as sc

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.mark.parametrize(("kind", "distributed_type", "backend", "stage", "sharded", "ref_backend"), [
    ("ddp", "MULTI_CPU", "ddp", None, False, "plain"),
    ("fsdp", "FSDP", "fsdp", None, True, "fsdp"),
    ("fsdp2", "FSDP", "fsdp2", None, True, "fsdp2"),
    ("zero2", "DEEPSPEED", "deepspeed", 2, False, "plain"),
    ("zero3", "DEEPSPEED", "deepspeed", 3, True, "deepspeed"),
])
def test_adapt_accelerate_prepared(
    group: Any, kind: str, distributed_type: str, backend: str, stage: int | None, sharded: bool, ref_backend: str
) -> None:
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in group.run(sc.prepared, kind, timeout=240):
        assert obs["distributed_type"] == distributed_type
        assert obs["backend"] == backend and obs["zero_stage"] == stage and obs["is_sharded"] == sharded
        assert obs["config"] == "LlamaConfig"  # never the engine's DeepSpeed dict
        assert obs["num_parameters"] == obs["expected"]
        # The reference next to an accelerate-prepared policy is sharded the same way (replicated
        # policies get a bare frozen module: DDP only exists to average gradients).
        assert obs["ref_backend"] == ref_backend and obs["ref_sharded"] == sharded and obs["ref_diff"] < 1e-5
        assert obs["generated"] == (2, 7) and obs["training_after"]


@pytest.mark.parametrize(("kind", "backend", "stage"), [
    ("fsdp", "fsdp", None),
    ("fsdp2", "fsdp2", None),
    ("zero2", "plain", None),  # below ZeRO-3 a reference is replicated: a bare frozen module
    ("zero3", "deepspeed", 3),
])
def test_trl_dropins(group: Any, kind: str, backend: str, stage: int | None) -> None:
    pytest.importorskip("trl")
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in group.run(sc.trl_dropins, kind, timeout=240):
        assert obs["ref_backend"] == backend and obs["ref_stage"] == stage
        assert obs["ref_diff"] < 1e-5 and obs["ref_eval"] and obs["ref_requires_grad"]
        # Per-rank share of the model the reference holds after a forward: half (sharded over the
        # two ranks), except FSDP1's root unit, which stays gathered next to its shard (the head
        # must live there for TRL's fused LM head), and a replicated reference.
        out = obs["outside_blocks"]
        expected = {"plain": 1.0, "fsdp": 1.5 * out + (1 - out) / 2}.get(backend, 0.5)
        assert obs["ref_resident"] == pytest.approx(expected, abs=0.01)
        if backend == "fsdp2":
            assert obs["ref_sharded_blocks"] == 2  # every decoder layer its own FSDP2 unit
        # unwrap_model_for_generation: full weights, eval, checkpointing off, generation_kwargs
        # applied; everything restored afterwards, also after an exception.
        assert obs["tokens_equal"] and not obs["inside_training"] and not obs["inside_ckpt"]
        assert obs["override_len"] == 4 + 2 and obs["config_restored"]
        assert obs["training_after"] and obs["ckpt_restored"] and obs["training_after_error"]
        assert obs["loss_finite"]
        if kind == "zero3":
            assert obs["ungathered_sharded"] and obs["ungathered_equal"]
            assert not obs["ungathered_training"] and obs["ungathered_after"]


@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_trl_dropin_errors(group: Any, kind: str) -> None:
    pytest.importorskip("trl")
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    for errors in group.run(sc.trl_dropin_errors, kind, timeout=120):
        assert len(errors) == 3
        assert all("got None" in e and "prepare_reference(policy)" in e for e in errors[:2])
        assert "not set up for" in errors[2] and "prepare_reference" in errors[2]


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp2", "zero2", "zero3"])
def test_accelerate_bf16(group: Any, kind: str) -> None:
    if kind.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in group.run(sc.mixed_precision, kind, timeout=240):
        assert obs["generation_dtype"] == obs["own_dtype"], f"{kind}: {obs}"
        # The reference computes in bf16 too (its logits are the policy's, not the fp32 model's), to a
        # bf16 rounding of the logits; accelerate's fp32 conversion of outputs is the prepared model's own.
        assert obs["ref_fp32_diff"] > 1e-4 and obs["ref_diff"] < 5e-3, f"{kind}: {obs}"
        assert obs["half_effect"] > 1e-4, f"{kind}: the prepared model does not compute in bf16: {obs}"
        assert obs["generation_diff"] == 0.0, f"{kind}: {obs}"
        assert obs["same_tokens"], f"{kind}: generate() decodes other tokens than the model's own forward"
        assert obs["training_after"]
