"""The data plane of vLLM's dense weight transfer, trainer side: rank 0 of the transfer group, over vLLM's own NCCL
communicator or a torch gloo group, each chunk's broadcast bounded by a timeout (``_vllm_dense`` drives it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..._errors import EngineError
from ...base.process_groups import join_weight_group
from ._engine_wire import sent_or_answered

__all__ = ["Wire", "gloo_group_name"]

def gloo_group_name(port: int) -> str:
    """The name of a gloo transfer group at ``port`` (vLLM has none: a receiver of wrapkit's tests, or one that
    adopts it, joins under this name)."""
    return f"vllm-weights-{port}"


class Wire:
    """The data plane, rank 0 of vLLM's transfer group (the engine's workers are ranks 1..N): vLLM's own NCCL
    communicator, or a torch gloo group. ``broadcast`` returns once the chunk left, or once the engine answered
    while it waited, or raises within the timeout."""

    def __init__(self, backend: str, address: str, port: int, world: int, timeout: float) -> None:
        self.backend, self.timeout = backend, timeout
        self.pending: torch.Tensor | None = None
        if backend == "gloo":
            _settled(port, timeout)
            self.group = join_weight_group(address, port, world, 0, gloo_group_name(port), "gloo", timeout)
            self.port = port
            return
        try:
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
        except ImportError as exc:
            raise EngineError("backend='nccl' joins vLLM's transfer group with vLLM's own NCCL communicator: "
                              "install the server's vLLM release (0.33) in the trainer's environment") from exc
        cuda: Any = torch.cuda  # its stream and event constructors are untyped
        device = torch.device("cuda", cuda.current_device())
        self.group = stateless_init_process_group(address, port, 0, world, device)
        if getattr(self.group, "disabled", False):  # vLLM's communicator turns itself off without NCCL
            raise EngineError("vLLM's NCCL communicator disabled itself on this rank (no NCCL here): its broadcasts "
                              "would send nothing; send from a rank with a GPU")
        self.stream = cuda.Stream(device)

    def broadcast(self, flat: torch.Tensor, answered: Callable[[], str | None]) -> str | None:
        """Send one chunk; None once it left, or what the engine answered while it waited (the chunk is then
        abandoned: the group is out of step and must be closed)."""
        if self.backend == "gloo":
            work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
            # gloo fails the send at the group's own timeout, with its own message; the poll's deadline is later.
            try:
                answer = sent_or_answered(work.is_completed, flat.numel(), self.timeout + 5, answered)
            except EngineError:
                _abandon(work, self.group, self.port)
                raise
            if answer is not None:
                _abandon(work, self.group, self.port)
                return answer
            work.wait()  # done: raises the transport's error, if it failed
            return None
        # On its own stream, waited for by polling: a worker that is gone must not hold this rank for ever.
        self.stream.wait_stream(torch.cuda.current_stream())
        self.group.broadcast(flat, src=0, stream=self.stream)
        cuda: Any = torch.cuda  # its event constructor is untyped
        done = cuda.Event()
        done.record(self.stream)
        answer = sent_or_answered(done.query, flat.numel(), self.timeout, answered)
        if answer is not None:
            self.pending = flat  # the kernel may still read it: held until close() aborts the communicator
        return answer

    def close(self) -> None:
        try:
            if self.backend == "gloo":
                dist.destroy_process_group(self.group)
            else:
                self.group.destroy()  # vLLM's: aborts the communicator
        except Exception:  # already gone with its peers: nothing left to release
            pass
        self.pending = None



_ABANDONED: dict[int, threading.Thread] = {}  # by port: the gloo groups left holding a chunk no one takes


def _abandon(work: Any, group: Any, port: int) -> None:
    """Let a gloo broadcast that no receiver will take end by its own timeout, away from the trainer (gloo cannot
    cancel it). Its group is held until then: the group's destructor waits for the work, and would otherwise block
    the rank that drops it. The thread is not a daemon, so an exiting process waits for it too (a gloo thread
    still holding Python's tensors while the interpreter finalizes aborts the process)."""

    def settle(held: Any = group) -> None:
        try:
            work.wait()
        except Exception:  # the timeout it was left to end by
            pass

    thread = threading.Thread(target=settle, name="wrapkit-abandoned-chunk")
    thread.start()
    _ABANDONED[port] = thread


def _settled(port: int, timeout: float) -> None:
    """Before a gloo group is joined at ``port`` again: the group abandoned there holds the port (its store)
    until its chunk's timeout, so a reconnect right after a refusal waits for that first."""
    left = _ABANDONED.pop(port, None)
    if left is None:
        return
    left.join(timeout + 5)
    if left.is_alive():
        _ABANDONED[port] = left
        raise EngineError(f"port {port} is still held by the transfer group a refused update left behind (its "
                          f"last chunk ends by the group's timeout): connect() again later, or on another port")
