"""What a scenario leaves behind in a worker, released before the next one runs: the process groups it made (each
gloo group keeps a thread that wakes 100 times a second), the caches that would hand a later scenario its meshes,
and the DeepSpeed engines and models that live on after their last reference."""

from __future__ import annotations

import gc
import importlib
import os
import sys
import types
import weakref
from typing import Any

__all__ = ["keep_groups", "release_kept_groups", "next_case", "settle", "leaked", "guarded", "live_groups"]


_started: set[Any] = set()  # the process groups alive once the worker had started
_kept: set[Any] = set()  # the groups a scenario asked to outlive it (keep_groups)
_destroyed: list[weakref.ref[Any]] = []  # the groups released after the last scenario, until they are freed
_thaw: list[bool] = []  # set where a kept scenario's objects, frozen since, are let go


def keep_groups() -> None:
    """Inside a scenario whose model lives on into later calls (the doctor keeps one per backend):
    the process groups made so far are not destroyed when the scenario returns."""
    _kept.update(live_groups())


def release_kept_groups() -> None:
    """The kept groups are destroyed when the current scenario returns."""
    _kept.clear()
    _thaw.append(True)


def live_groups() -> list[Any]:
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
        _started.update(live_groups())
        return
    gone = [pg for pg in live_groups() if pg not in _started and pg not in _kept]
    _destroyed.extend(weakref.ref(pg) for pg in gone)
    for pg in gone:
        try:
            dist.destroy_process_group(pg)
        except Exception:  # already shut down by its owner: nothing left to release
            pass
    if not gone:
        return
    gone_set = set(gone)
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        _forget(groups, gone_set)
        # The model-parallel unit a scenario handed DeepSpeed (kept in a public global) holds its groups too.
        if any(_is_gone(v, gone_set) for v in getattr(getattr(groups, "mpu", None), "__dict__", {}).values()):
            setattr(groups, "mpu", None)  # noqa: B010 (a module attribute mypy cannot see)
    _reset_megatron(gone_set)
    _clear_torch_caches()
    _clear_lru_caches(("torch.distributed", "deepspeed", "megatron"))


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
        _forget(state, gone)  # the ones its reset forgets (_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP in 0.16)


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


def _clear_lru_caches(prefixes: tuple[str, ...]) -> None:
    """Empty the functions memoised with lru_cache in the modules under ``prefixes``, in one pass over the
    loaded modules: module-level ones
    (redistribution's transform plans among them) and methods of their classes, wrapped or not. DeepSpeed
    memoises a method of ZeRO-3's parameter coordinator with no bound (keyed by the coordinator and a
    module), which keeps every ZeRO-3 engine a process built alive, with its model and groups; Megatron-Core
    memoises its rotary embeddings' forward the same way, keyed by the module that holds the groups."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefixes) or module is None:
            continue
        for value in list(vars(module).values()):
            # type() rather than isinstance(), which reads __class__: deprecated globals warn on any read.
            is_class = issubclass(type(value), type) and value.__module__ == name
            for v in list(vars(value).values()) if is_class else [value]:
                if type(v) in (staticmethod, classmethod):  # DTensor's mesh topology, cached per mesh
                    v = v.__func__
                for cached in (v, *(c.cell_contents for c in _cells(v))):
                    # By type name: reading attributes off every module global would trip deprecation warnings.
                    if type(cached).__name__ == "_lru_cache_wrapper":
                        cached.cache_clear()


def _cells(value: Any) -> list[Any]:
    """The closure cells of a plain function (a decorator's wrapper keeps the function it wraps in one)."""
    if type(value).__name__ != "function":
        return []
    return [c for c in (value.__closure__ or ()) if c != _EMPTY_CELL]


_EMPTY_CELL = types.CellType()  # cells compare by their contents; an empty one equals only another empty one


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


def guarded() -> bool:
    """Whether a scenario that leaves a group held fails (``WRAPKIT_WORKER_GUARD`` set and not ``0``)."""
    return os.environ.get("WRAPKIT_WORKER_GUARD", "0") not in ("", "0")


def leaked(target: str) -> str | None:
    """Why the scenario ``target`` should fail for what it left behind (process groups still held once
    it returned and the worker released what it made), or None. Said once: the groups are then forgotten,
    so a later scenario is not blamed for them. Where the guard is on (``guarded()``) the scenario fails
    with it; elsewhere it goes on. ``WRAPKIT_WORKER_TRACE`` prints one line per scenario to the rank's
    output: its threads, registered groups and held groups."""
    held = _held()
    if os.environ.get("WRAPKIT_WORKER_TRACE"):  # for measuring: one line per scenario
        print(f"wrapkit-worker threads={_thread_count()} groups={len(live_groups())} held={len(held)} {target}",
              file=sys.stderr, flush=True)
    if not held:
        return None
    _destroyed.clear()
    names = ", ".join(sorted({getattr(pg, "group_name", "?") for pg in held}))
    through = ""
    if guarded():  # seconds of work: only where the scenario fails for it
        from ._holders import holder_chains

        through = " Held through: " + "; ".join(holder_chains(held[0])) + "."
    return (f"{target} left {len(held)} process group(s) alive after it returned ({names}): it was destroyed, but "
            "something still refers to it (a module-level cache, a global, a library's registry), so its threads "
            f"run on and slow every later scenario; drop the reference before returning.{through}")


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


def settle() -> None:
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
    if _thaw:
        # What a scenario kept for later calls (the doctor's models) was frozen with the libraries when it
        # returned: once let go, its cycles are found only when it is back in the collected generations.
        _thaw.clear()
        gc.unfreeze()
    gc.collect()
    if _held() and _destroy_engines():
        gc.collect()
    # The imported libraries and anything still alive are moved out of the collected generations.
    gc.freeze()
