from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from wrapkit.cli._workers import WorkerError, WorkerGroup


# DeepSpeed compiles a CPU op on first use into TORCH_EXTENSIONS_DIR, keyed by op name only: the user's
# shared cache would be rebuilt by every DeepSpeed release that uses it in turn (and a build killed
# midway leaves a lock that blocks every later one). Each environment gets its own, as .ci/run does;
# the workers and launched scripts inherit it.
def _extensions_dir() -> str:
    if os.access(sys.prefix, os.W_OK):  # a virtual environment: beside its packages
        return os.path.join(sys.prefix, "torch_extensions")
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "wrapkit", f"torch_extensions-{key}")


os.environ.setdefault("TORCH_EXTENSIONS_DIR", _extensions_dir())

# The shared workers fail a scenario that leaves a process group alive after it returns, naming what holds it:
# each one left keeps its threads running and slows every later test (WRAPKIT_WORKER_GUARD=0 turns it off).
os.environ.setdefault("WRAPKIT_WORKER_GUARD", "1")

# Heavy libraries are imported once per worker when the group starts, not per scenario.
PRELOAD = ("transformers", "peft", "deepspeed")


class SharedGroup(WorkerGroup):
    """The shared workers, with one rerun for a rank killed by a native crash.

    gloo's worker threads abort the process now and then when they release a finished collective's tensors
    (``terminate called without an active exception``; measured at about 1 run in 10 of a torch-only DDP
    script). A scenario whose rank died so is run once more on a fresh group, and the crash is reported as a
    warning with its stack, so it stays visible; a second crash, or any other failure, fails the test."""

    def run(self, fn: Callable[..., Any] | str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        try:
            return super().run(fn, *args, timeout=timeout, **kwargs)
        except WorkerError as exc:
            if not any(f"was killed by {sig}" in str(exc) for sig in ("SIGABRT", "SIGSEGV", "SIGBUS")):
                raise
            warnings.warn(f"a rank crashed in native code; the scenario was run again on a fresh group:\n{exc}",
                          RuntimeWarning, stacklevel=2)
        return super().run(fn, *args, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    """Two gloo ranks shared by every distributed test; restarted after a failure kills it. Their output
    goes to log files, whose end a rank's death reports (a native crash prints its stacks there)."""
    g = SharedGroup(world_size=2, backend="gloo", preload=PRELOAD, log_dir=str(tmp_path_factory.mktemp("group")))
    yield g
    g.close()


@pytest.fixture(scope="session")
def group4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerGroup]:
    """Four gloo ranks, standing in for two nodes of two devices (the multi-node layouts)."""
    g = SharedGroup(world_size=4, backend="gloo", preload=PRELOAD, log_dir=str(tmp_path_factory.mktemp("group4")))
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-long", action="store_true",
                     help="also run the tests marked long (trainers, examples, soak, the repeats of a matrix)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_long(config, items)
    if torch.cuda.is_available() and not os.environ.get("WRAPKIT_NO_GPU"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _deselect_long(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default selection leaves out the tests marked ``long``, unless ``--run-long`` or ``-m`` is given
    or the test's file is named on the command line (a test asked for by name runs)."""
    if config.getoption("--run-long") or config.getoption("markexpr"):
        return
    named = {os.path.abspath(arg.split("::")[0]) for arg in config.args if os.path.isfile(arg.split("::")[0])}
    keep, dropped = [], []
    for item in items:
        (dropped if "long" in item.keywords and str(item.path) not in named else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
