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
import gc
import importlib
import os
import signal
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

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


_started: set[Any] = set()  # the process groups alive once the worker had started
_kept: set[Any] = set()  # the groups a scenario asked to outlive it (keep_groups)
_destroyed: list[weakref.ref[Any]] = []  # the groups released after the last scenario, until they are freed


def keep_groups() -> None:
    """Inside a scenario whose model lives on into later calls (the doctor keeps one per backend):
    the process groups made so far are not destroyed when the scenario returns."""
    _kept.update(_live_groups())


def release_kept_groups() -> None:
    """The kept groups are destroyed when the current scenario returns."""
    _kept.clear()


def _live_groups() -> list[Any]:
    # torch lists its groups only in this private registry; without it nothing is released.
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}))


def _release_groups() -> None:
    """Destroy the process groups the last scenario made (device meshes, ``new_group``) and forget
    DeepSpeed's module-level references to them.

    Each gloo group keeps a socket loop thread that wakes every 10 ms, and two worker threads: a
    worker that had run the test suite held 300 groups, 975 threads, and spent a fifth of a core
    idle, which slowed every later scenario on this machine several times over.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if not _started:
        _started.update(_live_groups())
        return
    gone = [pg for pg in _live_groups() if pg not in _started and pg not in _kept]
    _destroyed.extend(weakref.ref(pg) for pg in gone)
    for pg in gone:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # already shut down by its owner: nothing left to release
            pass
    if not gone:
        return
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        _forget(groups, set(gone))
    _reset_megatron(set(gone))
    _clear_torch_caches()


def _reset_megatron(gone: set[Any]) -> None:
    """Megatron-Core keeps its model-parallel groups in module globals until the next
    ``initialize_model_parallel``: about 20 groups (60 threads) after each of its scenarios. Where they are
    among the destroyed ones, its state is reset."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None:
        return
    values = [v for name, v in vars(state).items() if name.startswith("_") and not name.startswith("__")]
    listed = [item for v in values if isinstance(v, list) for item in v]  # _global_process_group_list
    if any(_is_gone(v, gone) for v in values + listed):
        state.destroy_model_parallel()


def _clear_torch_caches() -> None:
    """Empty torch.distributed's memoised lookups. DTensor's sharding propagation (in Python and in C++)
    and redistribution plans key on device meshes, which compare by their ranks and names: a later
    scenario's mesh equal to a destroyed one would be handed results holding the old mesh, and with it
    its destroyed groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    debug = importlib.import_module("torch.distributed.tensor.debug")
    redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(redistribute, "clear_redistribute_planner_cache", None)):
        if callable(clear):
            clear()
    # Module-level functions memoised with lru_cache (redistribution's transform plans among them).
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and module is not None:
            for value in list(vars(module).values()):
                # By type name: reading attributes off every module global would trip deprecation warnings.
                if type(value).__name__ == "_lru_cache_wrapper":
                    value.cache_clear()


def _forget(module: Any, gone: set[Any]) -> None:
    """Reset a library's cached groups that were destroyed, so that it makes new ones when asked."""
    for name, value in list(vars(module).items()):
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(value, dict):
            stale = [k for k, v in value.items() if _is_gone(v, gone)]
            for k in stale:
                del value[k]
                ranks = getattr(module, name + "_RANKS", None)
                if isinstance(ranks, dict):
                    ranks.pop(k, None)
        elif _is_gone(value, gone):
            setattr(module, name, None)


def _is_gone(value: Any, gone: set[Any]) -> bool:
    try:
        return value in gone
    except TypeError:  # unhashable values are not groups
        return False


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))  # native threads too (gloo's are not Python threads)
    except OSError:
        import threading

        return threading.active_count()


def _held() -> list[Any]:
    """The released process groups that something still holds: each keeps its threads (a gloo group's
    socket loop wakes 100 times a second) until the last reference goes."""
    _destroyed[:] = [r for r in _destroyed if r() is not None]
    return [pg for r in _destroyed if (pg := r()) is not None]


def _destroy_engines() -> int:
    """Call ``destroy()`` on the DeepSpeed engines the last scenario left: DeepSpeed keeps an engine alive
    after its last reference is dropped (its gradient hooks, held by autograd's nodes in C++, refer back to
    it, a cycle the garbage collector cannot see), and with it the process groups it uses."""
    engine = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine, "DeepSpeedEngine", None)
    if cls is None or _kept:  # a kept group's model (the doctor's) lives on
        return 0
    found = [o for o in gc.get_objects() if isinstance(o, cls)]
    for e in found:
        try:
            e.destroy()
        except Exception:  # a half-built engine: nothing more to release
            pass
    return len(found)


def _leaked(target: str) -> str | None:
    """Why the scenario ``target`` should fail for what it left behind (process groups still held once
    it returned and the worker released what it made), or None. Said once: the groups are then forgotten,
    so a later scenario is not blamed for them. Where ``WRAPKIT_WORKER_GUARD`` is set the scenario fails
    with it; elsewhere it goes on. ``WRAPKIT_WORKER_TRACE`` prints one line per scenario to the rank's
    output: its threads, registered groups and held groups."""
    held = _held()
    if os.environ.get("WRAPKIT_WORKER_TRACE"):  # for measuring: one line per scenario
        print(f"wrapkit-worker threads={_thread_count()} groups={len(_live_groups())} held={len(held)} {target}",
              file=sys.stderr, flush=True)
    if not held:
        return None
    _destroyed.clear()
    names = ", ".join(sorted({getattr(pg, "group_name", "?") for pg in held}))
    return (f"{target} left {len(held)} process group(s) alive after it returned ({names}): it was destroyed, but "
            "something still refers to it (a module-level cache, a global, a library's registry), so its threads "
            "run on and slow every later scenario; drop the reference before returning.")


def _forget_engine_modules() -> None:
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack.clear()


def next_case() -> None:
    """Between the cases of one scenario: let the last case's models go before the next is built.

    DeepSpeed keeps each engine alive (``FWD_MODULE_STACK``, and the cycle through its gradient hooks), and each
    ZeRO-3 engine that is built runs a full collection (its parameter defragmenting), which then walks every
    model the earlier cases left: in the family matrix's ZeRO-3 cases that collection took 0.12 s per engine.
    """
    _forget_engine_modules()
    gc.collect()
    if _destroy_engines():
        gc.collect()


def _settle() -> None:
    """Between scenarios: let go of what the last one left behind, and keep what lives on out of the
    garbage collector's full passes.

    DeepSpeed's ZeRO-3 keeps every engine's module in a module-level list (``FWD_MODULE_STACK``) for
    good; nothing runs a forward between scenarios, so the list holds only those. What still lives on
    after a collection (the libraries, and models the libraries hold on to by other ways) is frozen:
    in a worker that had run the test suite, each full collection walked 1.5 million objects, and
    later scenarios ran up to 3.5x slower than alone.
    """
    _forget_engine_modules()
    _release_groups()
    gc.collect()
    if _held() and _destroy_engines():
        gc.collect()
    # The imported libraries and anything still alive are moved out of the collected generations.
    gc.freeze()


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
        _settle()
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
        _settle()
        leak = _leaked(target)
        if leak is not None and reply[0] == "ok" and os.environ.get("WRAPKIT_WORKER_GUARD"):
            reply = ("err", leak)
        conn.send(reply)
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:
        pass


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
                f.seek(max(0, f.tell() - limit))
                tail = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
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
