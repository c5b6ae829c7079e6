"""Never a silent ``plain``: the module inside a wrapper (``engine.module``, ``fsdp.module``, the ``self.model`` that
transformers' and TRL's trainers hold) is read through the wrapper found to hold it, exactly as the wrapper is,
or refused with a typed error naming what to pass (``wrapkit/adapters/zero/inside.py``, ``flat/inside.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.adapters import scenarios_inside as sc
from tests.harness._matrix import cases, run

CASES = [
    {"spec": "zero3", "family": "llama", "precision": "fp32"},
    {"spec": "zero3", "family": "llama", "precision": "bf16"},
    {"spec": "zero3", "family": "qwen2-tied", "precision": "fp32"},
    {"spec": "zero3", "family": "qwen3-moe", "precision": "fp32"},
    {"spec": "zero3", "family": "llama", "precision": "fp32", "peft": True},
    {"spec": "zero2", "family": "llama", "precision": "bf16"},
    {"spec": "zero1", "family": "qwen2-tied", "precision": "fp32"},
    {"spec": "zero0", "family": "llama", "precision": "bf16"},
    {"spec": "ddp", "family": "qwen3-moe", "precision": "fp32", "peft": True},
]
LONG = [
    {"spec": "zero2", "family": "qwen3-moe", "precision": "fp32", "peft": True},
    {"spec": "zero3", "family": "gemma3", "precision": "bf16"},
    {"spec": "zero2", "family": "qwen2-tied", "precision": "bf16", "peft": True},
]


@cases(CASES, LONG)
def test_the_inside_of_a_wrapper_reads_as_the_wrapper(request: pytest.FixtureRequest, group: Any,
                                                       case: dict[str, Any]) -> None:
    """Against an unsharded twin's ``save_pretrained`` (save and stream), the wrapper's own adapter (generation,
    after a training step) and the optimizer's masters (a load through the inside is what the engine steps on)."""
    deepspeed = case["spec"].startswith("zero")
    for obs in run(request, group, sc.inside_reads, timeout=300):
        assert obs["backend"] == ("deepspeed" if deepspeed else "plain"), obs
        assert obs["module_is_inner"], obs  # wm(...) is still the given module's own forward
        if deepspeed:
            assert obs["stack"][0] == "deepspeed" and obs["given"], obs
            assert "not the DeepSpeedEngine itself" in obs["given"][0], obs
        for what in ("save", "save_as_wrapper", "stream", "after_step", "load"):
            assert obs[what] == [], (what, obs[what])
        assert obs["tokens"], obs
        assert obs["step_after_load"], obs  # the step moved the loaded weights: the check above can fail
        if "deep" in obs:
            assert obs["deep_backend"] == "deepspeed" and obs["deep"] == [], obs


def test_insides_that_cannot_be_read_whole_are_refused(group: Any) -> None:
    for obs in group.run(sc.inside_refusals, timeout=180):
        for what, said in obs.items():
            if what.startswith("fsdp ") and what != "fsdp root":
                assert said.startswith("UnsupportedModelError: ") and "inside an FSDP1 wrapper" in said, (what, said)
                assert "Pass the FullyShardedDataParallel root" in said, said
        assert obs["fsdp root"] == "adapted as fsdp", obs
        assert "is a FullyShardedDataParallel unit" in obs["fsdp uop=True per_block=True"], obs
        assert "is flattened by FullyShardedDataParallel" in obs["fsdp uop=True per_block=False"], obs
        assert "'_flat_param' is flattened" in obs["fsdp uop=False per_block=False"], obs
        assert obs["zero2 deep copy"] == "adapted as plain []", obs  # whole weights of its own, read as they are
        assert obs["fsdp2>peft below the root"] == obs["tp below the root"] == "[]", obs
        said = obs["zero3 deep copy"]
        assert said.startswith("deepcopy raised") or (
            said.startswith("UnsupportedModelError: ") and "every one holds 0 elements" in said), said


def test_the_inside_of_data_parallel_is_the_whole_model() -> None:
    """``DataParallel`` keeps the whole model in its module: read bare, it gives exactly what the wrapper gives."""
    import torch

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    dp = torch.nn.DataParallel(tiny_llama(0))
    inside, whole = wrapkit.adapt(dp.module), wrapkit.adapt(dp)
    assert (inside.backend, whole.backend) == ("plain", "dp")
    mine, theirs = inside.full_state_dict(), whole.full_state_dict()
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    assert not [line for line in inside.describe().splitlines() if line.startswith("given:")]
