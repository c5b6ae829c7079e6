"""The online-DPO example runs under torchrun on every distributed backend and learns its toy reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from wrapkit.cli._workers import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "online_dpo.py"
STEPS = 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["ddp", "fsdp", "fsdp2", "zero2", "zero3"])
def test_online_dpo_example(backend: str, tmp_path: Path) -> None:
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    ckpt = tmp_path / "out" / "policy.safetensors"
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(SCRIPT), "--backend", backend, "--steps", str(STEPS),
        "--save", str(ckpt), "--json", str(summary),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
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
