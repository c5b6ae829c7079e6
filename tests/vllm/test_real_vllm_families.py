"""wrapkit against a real vLLM serving other families: Qwen2 with attention biases (split with their weights by
tensor parallelism) and its head tied to the embedding, and Qwen3-MoE (experts sent one by one, in the Hub's
names). Same oracle as test_real_vllm.py. Both pass through vLLM's CPU build's reload only with the gloo backend's
repair of it (test_reload_bugs.py shows the build's own reload getting them wrong)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.server import Server
from tests.vllm.test_real_vllm import check_sync_step_sync
from tests.vllm.trainers.test_trl_loops import check_async

pytest.importorskip("vllm", reason="vLLM's CPU build runs in the vLLM stage's own environment (.ci/vllm)")


def test_tied_qwen2_with_biases_sync_step_sync(group: Any, qwen2_server: Server) -> None:
    # The Llama's 21 tensors, the six projection biases, the tied head sent once (as the embedding).
    check_sync_step_sync(qwen2_server, ["ddp", "tp", "fsdp2>peft", "zero3"], 26, group)


def test_qwen3_moe_sync_step_sync(group: Any, moe_server: Server) -> None:
    check_sync_step_sync(moe_server, ["ddp", "fsdp2", "zero3"], 45, group)


# TRL's async GRPO against the same server (trainers/test_trl_loops.py has the Llama's rows, the families' in
# colocate mode, and the check).
def test_async_grpo_weight_transfer_on_qwen3_moe(moe_server: Server, tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is installed in the vLLM stage's environment (.ci/vllm)")
    check_async(moe_server, tmp_path, "zero3", False, family="qwen3-moe")
