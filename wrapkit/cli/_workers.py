"""A long-lived group of worker processes joined in one ``torch.distributed`` group.

Starting a group with transformers and deepspeed imported costs seconds, so the
doctor and the test-suite start one group and send it many scenarios. A scenario
is a module-level function, named by ``module:qualname``, that every rank runs;
each rank's return value comes back in rank order. A scenario that does not
finish within its timeout (a hang in a collective, typically) kills the whole
group, which is restarted on the next call: a bug fails instead of hanging.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

# What a scenario leaves behind is the cleanup module's; the scenarios and the doctor import its names from here.
from ._worker_cleanup import guarded, keep_groups, leaked, next_case, release_kept_groups, settle

__all__ = ["WorkerGroup", "WorkerError", "free_port", "keep_groups", "next_case", "release_kept_groups"]


class WorkerError(RuntimeError):
    """A scenario failed or timed out on at least one rank."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve(target: str) -> Callable[..., Any]:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _worker_main(rank: int, world_size: int, port: int, backend: str, preload: Sequence[str], conn: Any,
                 log_dir: str | None = None) -> None:
    if log_dir is not None:
        # Everything this process prints (third-party warnings and notices included) goes to a file.
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # A crash in native code (a segfault, an abort in a library's thread) prints every thread's Python
    # stack to stderr before the process dies, so the report says where it was.
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        # One thread per rank: the ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        settle()
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        target, args, kwargs = msg
        try:
            result = _resolve(target)(*args, **kwargs)
            reply = ("ok", result)
        except BaseException:
            reply = ("err", traceback.format_exc())
        settle()
        leak = leaked(target)
        if leak is not None and reply[0] == "ok" and guarded():
            reply = ("err", leak)
        conn.send(reply)
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:
        pass


def crash_excerpt(text: str, limit: int = 4000) -> str:
    """What explains a crash in a rank's output, within about ``limit`` characters. A fatal signal's dump
    lists every thread, the crashing one anywhere among them, and ends with the extension modules: its
    last ``limit`` characters alone can miss both the signal and the stack that raised it. So: what was
    printed just before the dump (a C++ ``terminate`` message), its header, and the current thread's stack."""
    start = text.rfind("Fatal Python error")
    if start < 0:
        return text[-limit:]
    blocks = text[start:].split("\n\n")
    header = blocks[0]
    current = next((block for block in blocks if block.startswith("Current thread")), "")
    before = text[max(0, start - limit // 4):start].strip()
    parts = [p for p in (before, header, current) if p]
    return "\n\n".join(parts)[-limit:]


class WorkerGroup:
    """``world_size`` processes in one process group, running scenarios on request."""

    def __init__(self, world_size: int = 2, backend: str = "gloo", preload: Sequence[str] = (),
                 start_timeout: float = 180.0, log_dir: str | None = None) -> None:
        """``log_dir``: the workers' stdout and stderr go to ``rank<r>.log`` files there."""
        self.world_size = world_size
        self.log_dir = log_dir
        self.backend = backend
        self._preload = tuple(preload)
        self._start_timeout = start_timeout
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.backend, self._preload, child, self.log_dir),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(self._start_timeout, "starting the group")
        del replies

    def run(self, fn: Callable[..., Any] | str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        self.start()
        target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        for conn in self._conns:
            conn.send((target, args, kwargs))
        return self._collect(timeout, target)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if now > deadline:
                break
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.01):
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value = "err", self._death(rank)
                    pending.discard(rank)
                    if status == "err":
                        errors[rank] = value
                        # The other ranks may now wait forever in a collective: give them a little while.
                        deadline = min(deadline, time.monotonic() + 15.0)
                    else:
                        results[rank] = value
                elif not self._procs[rank].is_alive():
                    pending.discard(rank)
                    errors[rank] = self._death(rank)
                    deadline = min(deadline, time.monotonic() + 15.0)
        if pending or errors:
            timed_out = sorted(pending)
            self.close(force=True)
            parts = [f"{what} failed on rank {r}:\n{tb}" for r, tb in sorted(errors.items())]
            if timed_out:
                parts.append(f"{what} did not finish within {timeout:.0f} s on rank(s) {timed_out}; group killed")
            raise WorkerError("\n".join(parts))
        return results

    def _death(self, rank: int) -> str:
        """How rank ``rank``'s process ended, once it has (its pipe closes a moment before)."""
        proc = self._procs[rank]
        proc.join(timeout=5.0)
        code = proc.exitcode
        if code is None:
            return f"rank {rank} closed its pipe and is still running"
        if code >= 0:
            return f"rank {rank} exited with code {code}" + self._log_tail(rank)
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {"SIGKILL": " (the kernel's out-of-memory killer sends it: check free memory)",
               "SIGSEGV": " (a crash in native code: its stack is on the rank's stderr)",
               "SIGABRT": " (an abort in native code: its stack is on the rank's stderr)"}.get(name, "")
        return f"rank {rank} was killed by {name}{why}" + self._log_tail(rank)

    def _log_tail(self, rank: int, limit: int = 4000) -> str:
        """The end of a dead rank's log, where the group keeps one: a native crash's stacks are there."""
        if self.log_dir is None:
            return ""
        try:
            with open(os.path.join(self.log_dir, f"rank{rank}.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16 * limit))
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        tail = crash_excerpt(text, limit)
        return f"\n--- the end of rank {rank}'s output ---\n{tail}" if tail else ""

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
