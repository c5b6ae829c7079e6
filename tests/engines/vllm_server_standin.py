"""A stand-in for a vLLM 0.33 server's weight-transfer side (``VLLM_SERVER_DEV_MODE=1``), in a process of its own.

Written from vLLM's released source: the routes of ``vllm/entrypoints/rl/online/api_router.py`` and their bodies
(``init_info``, ``update_info`` and ``weight_version`` embedded; ``/pause`` takes its mode as a query; refusals
answered with HTTP 500, since a worker's error comes back as a failed ``collective_rpc``), the worker's session
rule (``gpu_worker.py``: ``start_weight_update`` twice, or ``update_weights`` / ``finish_weight_update`` without
one, fail; a failed update ends the session; empty lists reuse the last round's metadata) and the packed receive
of ``nccl_engine.py`` / ``packed_tensor.py`` (``tests/engines/vllm_standin.receive``: the chunk cut from the metadata
alone, each piece viewed in its dtype at its offset). The data plane is a gloo group of the trainer and one
worker, rank 1 (vLLM's is NCCL); the model is a transformers model loaded by the Hub's names, as vLLM's
``load_weights`` takes them (an unknown name fails the load).

    python tests/engines/vllm_server_standin.py --port P

Two routes of its own drive the tests: ``/standin_mode {"family", "refuse", "refuse_chunk", "exit_after",
"forget_version", "release"}`` builds a fresh model of that family, a route to refuse, a chunk whose load the
worker refuses (its index, negative from the last, or ``"middle"``; ``update_weights`` then answers HTTP 500 at
once, as vLLM's does when a worker raises), a chunk count after which the process exits while receiving, whether
``finish_weight_update`` forgets its version while answering success, and the release ``/version`` reports;
``/standin_dump {"path"}`` saves the model's state dict (where a path is given) and answers with the calls
received and when (``time.time()``) it last answered ``update_weights`` with an error. For the benchmarks,
``standin_mode`` takes a Llama ``size`` (``layers``, ``hidden``, ``vocab``), and ``/standin_bare {"sizes"}`` only
receives broadcasts of those sizes.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from wrapkit.integrations.engines._vllm_wire import gloo_group_name


class Engine:
    def __init__(self) -> None:
        self.group: Any = None
        self.lock = threading.Lock()
        self.standin_mode({})

    def standin_mode(self, req: dict[str, Any]) -> tuple[int, Any]:
        from tests.harness.standin_http import standin_model  # the repository is on the path (``__main__``)

        self.model = standin_model(req)
        self.refuse, self.exit_after = req.get("refuse"), req.get("exit_after")
        self.refuse_chunk, self.refused_at = req.get("refuse_chunk"), None
        self.forget_version = bool(req.get("forget_version"))
        self.release = req.get("release", "0.33.0")
        self.active, self.weight_version, self.meta = False, None, None
        self.calls: list[str] = []
        return 200, {"success": True}

    def handle(self, method: str, route: str, req: dict[str, Any]) -> tuple[int, Any]:
        route = route.split("?")[0]
        self.calls.append(route)
        if route == self.refuse:
            return 500, {"error": {"message": f"Call to collective_rpc method failed: {route} refused by the stand-in",
                                   "type": "InternalServerError", "code": 500}}
        handler = getattr(self, route, None)
        if handler is None or (method == "GET") != (route in ("weight_info", "version")):
            return 404, {"detail": "Not Found"}
        try:
            return handler(req)  # type: ignore[no-any-return]
        except Exception as exc:  # a worker's error, as vLLM's collective_rpc reports it
            self.refused_at = time.time()
            # vLLM's own words (a real 0.32 server's): str(exc) only, so a bare assertion arrives as ''.
            message = (f"Call to collective_rpc method failed: Worker failed with error '{exc}', please check the "
                       "stack trace above for the root cause")
            return 500, {"error": {"message": message, "type": "InternalServerError", "code": 500}}

    def init_weight_transfer_engine(self, req: dict[str, Any]) -> tuple[int, Any]:
        info = req["init_info"]
        if self.group is not None:  # vLLM builds a new communicator on each init; the old one is let go
            dist.destroy_process_group(self.group)
            self.group = None
        self.buffer = info.get("packed_buffer_size_bytes", 2**30)
        wait = datetime.timedelta(seconds=60)
        store, rank, world = next(c10d.rendezvous(f"tcp://{info['master_address']}:{info['master_port']}",
                                                  info["rank_offset"], info["world_size"], timeout=wait))
        name = gloo_group_name(info["master_port"])
        group, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend("gloo"), c10d.PrefixStore(name, store),
                                                  group_name=name, timeout=wait)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
        self.group = group
        return 200, {"message": "Weight transfer initialized"}

    def start_weight_update(self, req: dict[str, Any]) -> tuple[int, Any]:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.active = True
        return 200, {"message": "Weight update started"}

    def update_weights(self, req: dict[str, Any]) -> tuple[int, Any]:
        from tests.engines.vllm_standin import receive

        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        info = req["update_info"]
        if info["names"]:
            self.meta = list(zip(info["names"], info["dtype_names"], info["shapes"], strict=True))
        try:
            group = _Exiting(self.group, self.exit_after) if self.exit_after is not None else self.group
            if self.refuse_chunk is not None:
                group = _Refusing(group, self.refuse_chunk, _chunk_count(self.meta or [], self.buffer))
            with self.lock, torch.no_grad():
                receive(self.meta or [], group, self.buffer, self.model)
        except BaseException:
            self.active = False  # an error ends the session
            raise
        return 200, {"message": "Weights updated"}

    def finish_weight_update(self, req: dict[str, Any]) -> tuple[int, Any]:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        if not self.forget_version:
            self.weight_version = req.get("weight_version")
        return 200, {"message": "Weight update finished"}

    def weight_info(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    def version(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"version": self.release}

    def pause(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"status": "paused"}

    def resume(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"status": "resumed"}

    def reset_prefix_cache(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"success": True}

    def standin_bare(self, req: dict[str, Any]) -> tuple[int, Any]:
        """Receive broadcasts of ``sizes`` bytes, and nothing else (the benchmarks' bare transport)."""
        for n in req["sizes"]:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=self.group)
        return 200, {"success": True}

    def standin_dump(self, req: dict[str, Any]) -> tuple[int, Any]:
        if req.get("path"):
            with self.lock:
                torch.save({k: v.clone() for k, v in self.model.state_dict().items()}, req["path"])
        return 200, {"success": True, "calls": self.calls, "refused_at": self.refused_at}


class _Exiting:
    """The transfer group of a worker that dies after ``after`` chunks (its process exits mid-update)."""

    def __init__(self, group: Any, after: int) -> None:
        self.group, self.left = group, after

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if self.left == 0:
            os._exit(3)
        self.left -= 1
        return self.group.broadcast(tensors, opts)


class _Refusing:
    """The transfer group of a worker that refuses chunk ``at`` of ``count`` once it arrived (a load that fails
    half a second later)."""

    def __init__(self, group: Any, at: int | str, count: int) -> None:
        self.group, self.count, self.seen = group, count, 0
        self.at = count // 2 if at == "middle" else int(at) % count

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        work = self.group.broadcast(tensors, opts)
        work.wait()
        self.seen += 1
        if self.seen - 1 == self.at:
            # A load that fails after a while: the trainer has moved on to broadcasting the next chunk by then
            # (vLLM's consumer has the next chunk in flight while it loads one).
            time.sleep(0.5)
            if self.at == 0 and self.count > 1:  # the first of several: a bare assertion, as a shape that does not fit
                raise AssertionError()
            raise RuntimeError(f"the stand-in's worker refused chunk {self.at} of {self.count}")
        return work


def _chunk_count(meta: list[tuple[str, str, list[int]]], buffer: int) -> int:
    """How many chunks vLLM's cut makes of ``meta``: each closes right after the tensor that takes it past
    ``buffer`` bytes, and the last after the last tensor."""
    count, total = 0, 0
    for i, (_, dtype_name, shape) in enumerate(meta):
        total += math.prod(shape) * getattr(torch, dtype_name).itemsize
        if total > buffer or i == len(meta) - 1:
            count, total = count + 1, 0
    return count


def _engine() -> Any:
    return Engine().handle


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository: ``tests.engines``, ``tests.harness``
    from tests.harness.standin_http import main

    main(_engine)
