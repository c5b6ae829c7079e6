"""``shutdown``: the last call of a distributed training script, so that a finished run exits 0.

gloo's worker threads keep finished work items, with the tensors of earlier collectives in them,
for as long as their process group lives. A ``DistributedDataParallel`` wrapper, once created,
keeps the group alive until the process ends, even after ``destroy_process_group()`` and after
the wrapper itself is collected (measured with torch 2.13: the threads survive both). Threads
still running while the interpreter finalizes release those tensors without the GIL, and the
rank aborts with SIGABRT ("terminate called without an active exception") after all its work
is done: about one run in ten of a DDP script here; see
https://github.com/pytorch/pytorch/issues/190489 and the abandoned fix
https://github.com/pytorch/pytorch/pull/179291.

So: collect what the run left, destroy the group while everything is alive, and where the
communication threads are gone, exit normally. Where they are not, skip the interpreter's
finalization, the one step that can abort: run the ``atexit`` handlers, flush every open file,
and end the process with ``os._exit``.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import warnings
from typing import NoReturn

import torch.distributed as dist

from ._errors import ArgumentError

__all__ = ["shutdown"]

# Names that torch's gloo backend gives its threads (``pt_gloo_runloop``, ``gloo_tcp_loop``).
_COMM_THREAD_PREFIXES = ("pt_gloo", "gloo")


def shutdown(exit_code: int = 0) -> NoReturn:
    """End a distributed script: destroy the process group and exit with ``exit_code``, on every rank.

    Call it once, on every rank, after the last collective (it makes one more: a barrier). It never
    returns. ``atexit`` handlers run and open files are flushed on every path.

    :param exit_code: the process's exit status, 0-255.
    :raises ArgumentError: ``exit_code`` is not an int in 0-255 (before anything is torn down).
    """
    if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
        raise ArgumentError(f"shutdown(exit_code={exit_code!r}): pass an int in 0..255 (0: success)")
    gc.collect()  # wrappers and tensors left in reference cycles go while the group still exists
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
        gc.collect()
    if not _comm_threads_alive():
        sys.exit(exit_code)
    _run_exit_handlers()
    _flush_open_files()
    os._exit(exit_code)


def _comm_threads_alive() -> bool:
    """Whether a communication thread of a process group still runs (True where it cannot be told)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended while we looked
        if name.startswith(_COMM_THREAD_PREFIXES):
            return True
    return False


def _run_exit_handlers() -> None:
    run = getattr(atexit, "_run_exitfuncs", None)  # CPython's own; what a normal exit calls
    if callable(run):
        run()


def _flush_open_files() -> None:
    # A normal exit flushes a file object when finalization destroys it; os._exit does not.
    # isinstance() reads ``__class__``, which some deprecated objects answer with a warning
    # (torch.distributed.reduce_op): none of that is the user's to see at exit.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = [obj for obj in gc.get_objects() if isinstance(obj, io.IOBase)]
    for obj in files:
        try:
            if not obj.closed:
                obj.flush()
        except (OSError, ValueError):  # a detached or broken stream: nothing to save
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
