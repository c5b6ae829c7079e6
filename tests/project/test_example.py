"""The online-DPO example runs under torchrun on every distributed backend and learns its toy reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.harness.launch import ROOT, torchrun  # noqa: E402

SCRIPT = ROOT / "examples" / "online_dpo.py"
STEPS = 20


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["ddp", "fsdp", "fsdp2", "zero2", "zero3"])
def test_online_dpo_example(backend: str, tmp_path: Path) -> None:
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    ckpt = tmp_path / "out" / "policy.safetensors"
    summary = tmp_path / "summary.json"
    proc = torchrun(SCRIPT, "--backend", backend, "--steps", str(STEPS), "--save", str(ckpt), "--json", str(summary))
    assert "reward first=" in proc.stdout

    result = json.loads(summary.read_text())
    rewards = result["rewards"]
    assert result["backend"] == backend and len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 1.0, f"reward did not rise: {rewards}"

    from safetensors.torch import load_file

    from wrapkit.cli._models import tiny_llama

    state = load_file(str(ckpt))
    expected = tiny_llama().state_dict()
    assert set(state) == set(expected)
    assert all(state[k].shape == expected[k].shape for k in expected)
