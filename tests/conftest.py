from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from wrapkit.cli._workers import WorkerGroup

# Heavy libraries are imported once per worker when the group starts, not per scenario.
PRELOAD = ("transformers", "peft", "deepspeed")


@pytest.fixture(scope="session")
def group() -> Iterator[WorkerGroup]:
    """Two gloo ranks shared by every distributed test; restarted after a failure kills it."""
    g = WorkerGroup(world_size=2, backend="gloo", preload=PRELOAD)
    yield g
    g.close()


@pytest.fixture(scope="session")
def group4() -> Iterator[WorkerGroup]:
    """Four gloo ranks, standing in for two nodes of two devices (the multi-node layouts)."""
    g = WorkerGroup(world_size=4, backend="gloo", preload=PRELOAD)
    yield g
    g.close()


@pytest.fixture(scope="session")
def gpu_group() -> Iterator[WorkerGroup]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 1:
        pytest.skip("needs a CUDA GPU")
    g = WorkerGroup(world_size=min(2, n), backend="nccl", preload=PRELOAD)
    yield g
    g.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and not os.environ.get("WRAPKIT_NO_GPU"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
