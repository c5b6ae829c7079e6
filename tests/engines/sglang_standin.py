"""A stand-in for an SGLang 0.5.23 server's weight-update side, in a process of its own.

Written from SGLang's released source: the HTTP routes and their payloads (``sglang/srt/entrypoints/
http_server.py``, ``managers/io_struct.py``), the weight-update group as ``init_custom_process_group`` builds it
(a ``tcp://`` rendezvous as a client, the store wrapped in a prefix of the group's name, torch's group
constructor), the session rule (every update between ``begin_weight_update`` and ``end_weight_update``), and the
``flattened_bucket`` receive (``weight_sync/tensor_bucket.py``: offsets rebuilt from names, dtypes and shapes,
an unaligned tensor or an empty bucket refused before the broadcast). The model is a transformers model loaded
by the Hub's names, as SGLang's ``load_weights`` takes them; the data plane is gloo.

    python tests/engines/sglang_standin.py --port P

prints ``ready`` once it listens. Two routes of its own drive the tests: ``/standin_mode {"family", "refuse",
"skip", "exit_after"}`` builds a fresh model of that family and sets a route to refuse (``success: false``), a
name part whose tensors are dropped while success is still answered (as SGLang does for names its model does not
know), and a count of updates after which the process exits as the next one is sent;
``/standin_dump {"path"}`` saves the model's state dict and answers with the calls received. For the benchmarks,
``standin_mode`` takes a Llama ``size`` (``layers``, ``hidden``, ``vocab``), and ``/standin_bare {"sizes"}`` only
receives broadcasts of those sizes.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from wrapkit import Bucket, BucketEntry
from wrapkit.integrations.vllm import load_into


class Engine:
    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.standin_mode({})

    def standin_mode(self, req: dict[str, Any]) -> tuple[int, Any]:
        from tests.harness.standin_http import standin_model  # the repository is on the path (``__main__``)

        self.model = standin_model(req)
        self.refuse, self.skip = req.get("refuse"), req.get("skip")
        self.exit_after = req.get("exit_after")  # updates taken before the process exits while receiving one
        self.session = False
        self.calls: list[str] = []
        return 200, {"success": True}

    def handle(self, route: str, req: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append(route)
        if route == self.refuse:
            return 400, {"success": False, "message": f"{route} refused by the stand-in"}
        handler = getattr(self, route, None)
        if handler is None:
            return 404, {"detail": "Not Found"}
        return handler(req)  # type: ignore[no-any-return]

    def init_weights_update_group(self, req: dict[str, Any]) -> tuple[int, Any]:
        rank, world = req["rank_offset"], req["world_size"]
        wait = datetime.timedelta(seconds=60)
        store, rank, world = next(c10d.rendezvous(f"tcp://{req['master_address']}:{req['master_port']}", rank,
                                                  world, timeout=wait))
        store = c10d.PrefixStore(req["group_name"], store)
        group, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend(req.get("backend", "nccl")), store,
                                                  group_name=req["group_name"], timeout=wait)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
        self.groups[req["group_name"]] = group
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def begin_weight_update(self, req: dict[str, Any]) -> tuple[int, Any]:
        self.session = True
        return 200, {"success": True, "message": "Weight update session opened."}

    def end_weight_update(self, req: dict[str, Any]) -> tuple[int, Any]:
        self.session = False
        return 200, {"success": True, "message": "Weight update session closed."}

    def pause_generation(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, req: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def update_weights_from_distributed(self, req: dict[str, Any]) -> tuple[int, Any]:
        if not self.session:
            return 400, {"success": False, "message": "update_weights_from_distributed must be called between "
                                                      "begin_weight_update and end_weight_update"}
        if req["group_name"] not in self.groups:
            return 400, {"success": False, "message": f"Group {req['group_name']} not in {list(self.groups)}"}
        if req.get("load_format") != "flattened_bucket":
            return 400, {"success": False, "message": "the stand-in takes load_format='flattened_bucket' only"}
        entries, offset = [], 0
        for name, dtype_name, shape in zip(req["names"], req["dtypes"], req["shapes"], strict=True):
            dtype = getattr(torch, dtype_name)
            if offset % dtype.itemsize:
                return 400, {"success": False,
                             "message": f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"}
            entries.append(BucketEntry(name, tuple(shape), dtype, offset))
            offset += int(torch.Size(shape).numel()) * dtype.itemsize
        if not entries:
            return 400, {"success": False, "message": "Cannot create empty tensor bucket"}
        flat = torch.empty(offset, dtype=torch.uint8)
        if self.exit_after is not None and self.calls.count("update_weights_from_distributed") > self.exit_after:
            os._exit(3)  # a server that dies in the middle of an update
        dist.broadcast(flat, src=0, group=self.groups[req["group_name"]])
        # SGLang's load_weights passes over names its model does not know, and still answers success.
        kept = [e for e in entries if self.skip is None or self.skip not in e.name]
        try:
            with self.lock, torch.no_grad():
                load_into(self.model, [Bucket(flat, kept)])
        except Exception as exc:
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}."}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def get_weights_by_name(self, req: dict[str, Any]) -> tuple[int, Any]:
        tensor = self.model.state_dict().get(req["name"])
        if tensor is None:
            return 400, {"object": "error", "message": "Get parameter by name failed", "code": 400}
        return 200, tensor.to(torch.float32).tolist()[: req.get("truncate_size", 100)]

    def standin_bare(self, req: dict[str, Any]) -> tuple[int, Any]:
        """Receive broadcasts of ``sizes`` bytes on the last group joined, and nothing else (the benchmarks' bare
        transport)."""
        group = list(self.groups.values())[-1]
        for n in req["sizes"]:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=group)
        return 200, {"success": True}

    def standin_dump(self, req: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            torch.save({k: v.clone() for k, v in self.model.state_dict().items()}, req["path"])
        return 200, {"success": True, "calls": self.calls}


def _post_only() -> Any:
    engine = Engine()
    return lambda method, route, req: engine.handle(route, req) if method == "POST" else (404, {})


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository, for ``tests.harness.standin_http``
    from tests.harness.standin_http import main

    main(_post_only)
