"""torchtitan's own models, sharding, optimizer container and checkpoint layout (``tests/torchtitan_run.py`` under
torchrun on two gloo ranks), read by wrapkit.

torchtitan (with the triton its import needs on a CPU build) runs in an environment of its own; ``.ci/run`` builds
it. By hand::

    python3 -m venv .venv-titan && . .venv-titan/bin/activate && pip install torch==2.13.0 uv \\
        && uv pip install -e ".[transformers]" torchtitan==0.3.0 triton==3.7.1 pytest pytest-timeout \\
        && python -m pytest tests/test_torchtitan.py
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan.models.llama3", reason="torchtitan is not installed here (it needs an environment of its own: see "
    "tests/test_torchtitan.py's docstring, or run .ci/run, which builds one)")

from tests.launch import ROOT, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("torchtitan")
    torchrun(ROOT / "tests" / "torchtitan_run.py", str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_reference_is_sharded_as_torchtitan_sharded_the_policy(ranks: list[dict[str, Any]]) -> None:
    for obs in ranks:
        assert obs["backend"] == "fsdp2"
        # torchtitan's units: the embedding, each block, the norm and the head together (the root aside).
        assert obs["policy_units"] == [["layers.0"], ["layers.1"], ["lm_head", "norm"], ["tok_embeddings"]], obs
        assert obs["reference_units"] == obs["policy_units"]
        assert obs["before_copy"] > 0 and obs["after_copy"] == 0.0, obs


def test_torchtitans_checkpoint_resumes_on_another_backend(ranks: list[dict[str, Any]]) -> None:
    for obs in ranks:
        assert obs["weights_equal"] and obs["moments_equal"], obs
        assert obs["lr"] == [1e-3], obs["lr"]
        assert obs["skipped"] and "scheduler" in obs["skipped"][0], obs["skipped"]


def test_a_fused_projection_renamed_by_its_hooks_is_refused_not_misread(ranks: list[dict[str, Any]]) -> None:
    for obs in ranks:
        assert "missing from the torchtitan checkpoint" in obs["fused"], obs["fused"]
        assert "layers.0.attention.qkv_linear.wqkv.weight" in obs["fused"], obs["fused"]
