"""Models prepared by accelerate, adapted by wrapkit (two real gloo ranks).

accelerate selects FSDP only on accelerator devices, so its FSDP setups cannot run on
a CPU-only machine; its DDP and DeepSpeed setups can, and are tested here."""

from __future__ import annotations

from typing import Any

import pytest

from tests import scenarios_accelerate as sc


@pytest.mark.parametrize(("kind", "backend", "stage", "sharded"), [
    ("ddp", "ddp", None, False),
    ("zero2", "deepspeed", 2, False),
    ("zero3", "deepspeed", 3, True),
])
def test_adapt_accelerate_prepared(group: Any, kind: str, backend: str, stage: int | None, sharded: bool) -> None:
    for obs in group.run(sc.prepared, kind, timeout=240):
        assert obs["backend"] == backend and obs["zero_stage"] == stage and obs["is_sharded"] == sharded
        assert obs["config"] == "LlamaConfig"  # never the engine's DeepSpeed dict
        assert obs["num_parameters"] == obs["expected"]
        # The reference next to an accelerate-prepared policy is sharded the same way.
        assert obs["ref_sharded"] == sharded and obs["ref_diff"] < 1e-5
        assert obs["generated"] == (2, 7) and obs["training_after"]
