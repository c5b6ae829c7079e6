"""How ``save_state`` writes: the files DCP's own writer writes, reaching the disk while they are written, and
no collection of the whole heap in the middle of a save or load."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import wrapkit
import wrapkit.training.state as training_state
from tests.harness._matrix import long
from tests.training import scenarios_resume as sc
from wrapkit.cli._models import tiny_llama
from wrapkit.formats import writeback


@pytest.mark.parametrize("spec", ["zero3", long("ddp")])
def test_two_ranks_write_what_dcps_own_save_writes(group: Any, tmp_path: Path, spec: str) -> None:
    """ZeRO-3's partitions (views of the flat buffers), and DDP's replicas (DCP's planning spreads each over one
    rank): the same files, items and metadata as DCP's own save, on the first save and from its plans after."""
    group.run(sc.written_both_ways, str(tmp_path), spec, timeout=120)


def test_saves_after_the_first_on_the_same_ranks_and_another_models_load_exactly(group: Any, tmp_path: Path) -> None:
    """DCP keeps its plans between saves over the same ranks: the later saves of a model, and a save of another
    model (its own plans) over the same ranks, each load back to the state saved."""
    for diffs in group.run(sc.saved_again, str(tmp_path), "zero3", "fsdp2", timeout=120):
        assert set(diffs) == {"a1", "b0", "b1"} and max(diffs.values()) == 0.0, diffs


def _stepped(seed: int = 0) -> tuple[Any, Any, Any]:
    wm = wrapkit.adapt(tiny_llama(seed, layers=2))
    opt, sched = sc._optimizer(wm, 1e-2, 2)
    sc._steps(wm, opt, sched, 0)
    return wm, opt, sched


def test_save_state_writes_what_dcps_own_save_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wm, opt, sched = _stepped()
    for name in ("ours", "again"):  # the second from the first's plans
        wm.save_state(tmp_path / name, opt, scheduler=sched)
    monkeypatch.setattr(training_state, "write", sc.dcps_own_save)
    wm.save_state(tmp_path / "stock", opt, scheduler=sched)
    sc.same_files(tmp_path / "ours", tmp_path / "stock")
    sc.same_files(tmp_path / "again", tmp_path / "stock")


def test_written_bytes_are_handed_to_the_disk_as_they_are_written(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform == "linux":  # the call exists on Linux; elsewhere the files are only fsynced at the end
        assert writeback._KICK_CALL is not None
    kicks: list[tuple[int, int]] = []
    real = writeback._KICK_CALL

    def kick(fd: int, offset: int, nbytes: int, flags: int) -> int:
        kicks.append((offset, nbytes))
        return real(fd, offset, nbytes, flags) if real is not None else 0

    monkeypatch.setattr(writeback, "_KICK_CALL", kick)
    monkeypatch.setattr(writeback, "KICK", 2**20)
    chunk = bytes(range(256)) * 1024 * 3  # 768 KiB
    with open(tmp_path / "f", "wb") as f:
        stream = writeback._WritingBack(f)
        for _ in range(6):
            stream.write(chunk)
        # fileno() flushes what is buffered: an fsync right after it covers every byte written.
        assert os.fstat(stream.fileno()).st_size == 6 * len(chunk) == stream.tell()
        stream.close()
        assert f.closed
    # Every byte written before the last request was handed over once, in order, in requests of KICK bytes or more.
    assert kicks and kicks[0][0] == 0 and all(n >= 2**20 for _, n in kicks)
    assert all(a + n == b for (a, n), (b, _) in zip(kicks, kicks[1:], strict=False))
    assert (tmp_path / "f").read_bytes() == chunk * 6


def _collections(wm: Any, opt: Any, sched: Any, directory: Path, enabled: bool) -> list[int]:
    """The generations collected while ``wm`` saves and loads, the collector on (``enabled``) with a threshold at
    which the call's own few objects start none, and thousands start many."""
    collections: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    threshold, was = gc.get_threshold(), gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gc.collect()
    gc.set_threshold(300)
    gc.callbacks.append(seen)
    try:
        wm.save_state(directory, opt, scheduler=sched)
        assert gc.isenabled() is enabled
        wm.load_state(directory, opt, scheduler=sched)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        (gc.enable if was else gc.disable)()
    return collections


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_runs_during_a_save_or_load_and_the_collector_is_left_as_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    wm, opt, sched = _stepped()
    # At most the young generation's collection once the collector is back on, at the end of each call.
    assert set(_collections(wm, opt, sched, tmp_path / "a", enabled)) <= ({0} if enabled else set())
    assert len(_collections(wm, opt, sched, tmp_path / "c", enabled)) <= 2
    if enabled:  # the same calls without the pause: DCP's objects start collections
        monkeypatch.setattr(training_state, "collector_paused", contextlib.nullcontext)
        assert len(_collections(wm, opt, sched, tmp_path / "b", enabled)) > 3
