"""wrapkit against a real vLLM serving a family with attention biases (Qwen2: biases on the query, key and value
projections, which tensor parallelism splits with their weights). Same oracle as test_real_vllm.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.conftest import Server
from tests.vllm.test_real_vllm import check_sync_step_sync

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")


def test_qwen2_sync_step_sync_matches_the_trained_model(group: Any, qwen2_server: Server) -> None:
    # 21 tensors of the Llama shape and the six projection biases.
    check_sync_step_sync(qwen2_server, ["ddp", "tp", "fsdp2>peft", "zero3"], 27, group)
