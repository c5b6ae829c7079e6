"""The worker group the doctor and the tests run scenarios on: a rank that dies says how."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from wrapkit.cli._workers import WorkerError, WorkerGroup, crash_excerpt


def die_on_rank_1(sig: int) -> int:
    """Rank 1 dies by ``sig`` while rank 0 waits for it in a collective."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), sig)
    dist.barrier()
    return dist.get_rank()


@pytest.mark.long  # each case starts and kills a group of its own
@pytest.mark.parametrize("sig, hint", [(signal.SIGSEGV, "native code"), (signal.SIGKILL, "out-of-memory")])
def test_a_rank_killed_by_a_signal_is_named_with_its_stack(tmp_path: Path, sig: int, hint: str) -> None:
    with WorkerGroup(world_size=2, log_dir=str(tmp_path)) as g:
        assert g.run(die_on_rank_1, 0, timeout=60) == [0, 1]  # signal 0 only checks the process exists
        with pytest.raises(WorkerError) as info:
            g.run(die_on_rank_1, int(sig), timeout=60)
    message = str(info.value)
    assert f"rank 1 was killed by {signal.Signals(sig).name}" in message and hint in message
    assert "failed on rank 0" in message  # the survivor's error is reported beside it
    log = (tmp_path / "rank1.log").read_text()
    if sig == signal.SIGSEGV:  # a handler can run: faulthandler prints where the rank was
        assert "Fatal Python error" in log and "die_on_rank_1" in log
        assert "die_on_rank_1" in message.split("the end of rank 1's output")[1]  # and the report shows it


ABORT_AMONG_THREADS = """
import faulthandler, os, sys, threading, time
faulthandler.enable(all_threads=True)
started = threading.Event()
def abort_here():
    started.wait()
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
crashing = threading.Thread(target=abort_here)
crashing.start()
for _ in range(60):  # a worker has dozens of threads: their stacks fill the dump
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
def deep(n):  # the main thread's stack, listed last, fills its end
    if n:
        return deep(n - 1)
    started.set()
    crashing.join()
deep(200)
"""


def test_a_crash_report_keeps_the_signal_and_the_crashing_stack() -> None:
    import subprocess
    import sys

    err = subprocess.run([sys.executable, "-c", ABORT_AMONG_THREADS], capture_output=True, text=True,
                         timeout=60).stderr
    assert len(err) > 8000 and "abort_here" not in err[-2000:]  # the plain tail would miss them
    excerpt = crash_excerpt(err, limit=2000)
    assert len(excerpt) <= 2000
    assert "terminate called without an active exception" in excerpt
    assert "Fatal Python error: Aborted" in excerpt and "abort_here" in excerpt
    assert crash_excerpt("x" * 50 + "the end", limit=10) == "x" * 3 + "the end"  # no crash: the plain tail


def build_zero3() -> None:
    """Build a ZeRO-3 model, run a training forward and backward, and drop it."""
    import torch

    import wrapkit
    from wrapkit.cli._models import build

    wm = wrapkit.adapt(build("zero3"))
    tokens = torch.arange(16).reshape(2, 8)
    wm.module.backward(wm(input_ids=tokens, labels=tokens).loss)


def what_a_full_collection_walks() -> tuple[int, int]:
    """The objects a full collection would walk now, and DeepSpeed's list of ZeRO-3 modules."""
    import gc
    import sys

    offload = sys.modules["deepspeed.runtime.zero.parameter_offload"]
    return len(gc.get_objects()), len(offload.FWD_MODULE_STACK)


def test_a_full_collection_walks_only_what_the_scenario_made(group: Any) -> None:
    """Between scenarios the group drops DeepSpeed's list of every ZeRO-3 module it built, and puts what
    lives on (imported libraries, what earlier scenarios left) out of the collector's full passes: a
    worker that had run the suite walked 1.5 million objects in each one, and later scenarios ran up
    to 3.5 times slower than alone."""
    group.run(build_zero3, timeout=120)
    for walked, zero3_modules in group.run(what_a_full_collection_walks, timeout=30):
        assert zero3_modules == 0 and walked < 20_000, (walked, zero3_modules)


def make_groups() -> tuple[int, int]:
    """Make a device mesh and a subgroup, as a scenario does; the number of groups and threads now."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    dist.new_group([0, 1])
    return len(distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))


def test_the_groups_a_scenario_made_are_destroyed_when_it_returns() -> None:
    # Each gloo group keeps three threads, one waking every 10 ms: a worker that had run the suite
    # held hundreds of them and slowed every later scenario several times over.
    with WorkerGroup(world_size=2) as g:
        first = g.run(make_groups, timeout=60)
        for _ in range(4):
            again = g.run(make_groups, timeout=60)
    assert [groups for groups, _ in again] == [groups for groups, _ in first]
    assert all(threads <= before + 2 for (_, threads), (_, before) in zip(again, first, strict=True))


_HELD: list[Any] = []


def keep_a_group() -> str:
    """A scenario that leaves a process group referenced from a module-level list once it returns."""
    import torch.distributed as dist

    _HELD.append(dist.new_group([0, 1]))
    return "returned"


@pytest.mark.long  # the harness's own guard, on groups of its own (11 s); every default scenario runs under it
def test_a_scenario_that_leaves_a_group_referenced_fails_naming_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group is destroyed when the scenario returns, but its threads live as long as something
    refers to it: under the guard, the scenario that left the reference fails, and the next one is not
    blamed."""
    monkeypatch.setenv("WRAPKIT_WORKER_GUARD", "1")  # the workers inherit it when they start
    with WorkerGroup(world_size=2) as g:
        assert g.run(make_groups, timeout=60)
        with pytest.raises(WorkerError) as info:
            g.run(keep_a_group, timeout=60)
        assert g.run(make_groups, timeout=60)
    message = str(info.value)
    assert "keep_a_group left 1 process group(s) alive after it returned" in message, message
    assert "drop the reference" in message
    # The chain from the module global that holds it.
    assert f"Held through: {__name__}._HELD -> list -> ProcessGroup" in message, message


def build_zero(stage: int) -> int:
    """Build a ZeRO engine, take a training step, drop it; this rank's threads afterwards."""
    import torch

    import wrapkit
    from wrapkit.cli._models import build

    wm = wrapkit.adapt(build(f"zero{stage}"))
    tokens = torch.arange(16).reshape(2, 8)
    wm.module.backward(wm(input_ids=tokens, labels=tokens).loss)
    wm.module.step()
    return len(os.listdir("/proc/self/task"))


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dropped_deepspeed_engine_lets_its_groups_go(group: Any, stage: int) -> None:
    """DeepSpeed keeps an engine alive after its last reference (its gradient hooks, held by autograd in
    C++, refer back to it) and with it the group it cloned from the world: the worker calls the engine's
    own destroy(), so four engines in a row leave no threads behind."""
    before = group.run(thread_count, timeout=30)
    for _ in range(4):
        group.run(build_zero, stage, timeout=120)
    after = group.run(thread_count, timeout=30)
    assert after == before, (before, after)


def abort_once_on_rank_1(marker: str) -> int:
    """Rank 1 aborts the first time (``marker`` is not there yet); every later call returns."""
    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return dist.get_rank()  # no collective: rank 0 does not wait for the dead rank


@pytest.mark.long  # the harness's own rerun, on groups of its own (9 s)
def test_the_shared_group_reruns_a_scenario_once_after_a_native_crash(tmp_path: Path) -> None:
    from tests.conftest import SharedGroup

    with SharedGroup(world_size=2, log_dir=str(tmp_path)) as g:
        with pytest.warns(RuntimeWarning, match="rank 1 was killed by SIGABRT"):
            assert g.run(abort_once_on_rank_1, str(tmp_path / "crashed"), timeout=60) == [0, 1]
        with pytest.raises(WorkerError, match="boom"):  # any other failure is not rerun
            g.run(raise_boom, timeout=60)


def raise_boom() -> None:
    raise ValueError("boom")
