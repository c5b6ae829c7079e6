"""Running a script under torchrun on two local ranks, for the tests that need a launched job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from wrapkit.cli._workers import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, *args: str, timeout: float = 280, cwd: Path = ROOT,
             **env_extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` under ``torchrun --nproc_per_node 2`` from ``cwd`` (the repository root), with a
    fresh port and none of this process's rank variables; fails the test on a non-zero exit,
    showing the end of both outputs."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(env_extra)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    errors = _without_warnings(proc.stderr)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{errors[-6000:]}"
    return proc


def _without_warnings(text: str) -> str:
    """``text`` less Python's warning lines (and the source line each quotes), which otherwise fill
    the shown end of a failed run's output and hide the error (torch prints one per collective)."""
    out: list[str] = []
    skip_next = False
    for line in text.splitlines():
        if skip_next and line.startswith("  "):
            skip_next = False
            continue
        skip_next = "Warning: " in line
        if not skip_next:
            out.append(line)
    return "\n".join(out)


def report_and_close(obs: Any, path: str | Path) -> None:
    """In a launched script: gather every rank's observations, write them as JSON from rank 0,
    then ``wrapkit.shutdown()``: the group destroyed and the process ended with exit code 0,
    without the abort at interpreter exit that gloo's threads can cause (wrapkit/shutdown.py)."""
    import json

    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obs)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(everyone))
    import wrapkit

    wrapkit.shutdown()
