"""TRL's server mode on wrapkit's ``VLLMEngine`` (``patch_trl(vllm_server=True)``).

TRL's ``VLLMGeneration`` in server mode joins the server's weight-transfer group through its own
``VLLMClient``: NCCL only (CUDA), no timeout on the transfer, and nothing checked after it. With
``vllm_server=True``, ``patch_trl()`` keeps TRL's client for generation and hands the weights to a
``VLLMEngine`` instead: every rank enters each sync together, the server is paused and resumed around
it, every step has a timeout, and the weight version the server reports afterwards is checked. The
transfer group is gloo on a CPU trainer (a server started with wrapkit's ``gloo`` backend) and vLLM's
NCCL on a GPU one. TRL's configuration is unchanged: ``vllm_server_base_url`` (or host and port),
``vllm_group_port`` and ``vllm_server_timeout`` are read from it.
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

from .._errors import EngineError
from ._trl_sync import prepared_policy

__all__ = ["ServerSync", "server_methods"]

_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


class ServerSync:
    """The two ``VLLMGeneration`` methods that server mode replaces; colocate mode runs TRL's own (``originals``)."""

    def __init__(self, originals: dict[str, Any], timeout: float) -> None:
        self.originals, self.timeout = originals, timeout

    def init_vllm(self, generation: Any) -> None:
        """TRL's client on the main process (for generation only: no NCCL communicator), and on every rank a
        ``VLLMEngine`` joined to the server's transfer group, as ``generation.wrapkit_engine``."""
        if generation.mode != "server":
            self.originals["_init_vllm"](generation)
            return
        from trl.generation.vllm_client import VLLMClient

        from .engines._engine_wire import request, share
        from .engines._vllm_engine import VLLMEngine

        accelerator = generation.accelerator
        url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"
        ranks: Any = None
        if accelerator.is_main_process:
            try:
                generation.vllm_client = VLLMClient(base_url=url, group_port=generation.group_port,
                                                    connection_timeout=generation.server_timeout)
                ranks = int(request(url, "get_world_size", None, self.timeout, method="GET")[1]["world_size"])
            except Exception as exc:  # learned by every rank below, not raised here alone
                ranks = f"{type(exc).__name__}: {exc}"
        ranks = share(ranks, 0)
        if not isinstance(ranks, int):
            raise EngineError(f"patch_trl(vllm_server=True): the vLLM server at {url} did not answer ({ranks}): "
                              "start it (vllm serve with VLLM_SERVER_DEV_MODE=1 and a --weight-transfer-config) "
                              "before the trainer, or raise vllm_server_timeout")
        backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
        engine = VLLMEngine(url, timeout=self.timeout, master_port=generation.group_port,
                            master_address=_address_towards(url), engine_ranks=ranks, backend=backend)
        engine.connect()
        generation.wrapkit_engine = engine
        accelerator.wait_for_everyone()

    def sync_weights(self, generation: Any) -> None:
        """One checked update of the policy, read through its adapter in the Hub's layout (LoRA merged without
        touching the live weights); then TRL's prefix-cache reset."""
        engine = getattr(generation, "wrapkit_engine", None)
        if generation.mode != "server" or engine is None:
            self.originals["sync_weights"](generation)
            return
        wm = prepared_policy(generation.model, generation.accelerator)
        engine.sync(wm, merge_adapters="peft" in wm.stack)


def _address_towards(url: str) -> str:
    """This host's address as the server sees it: loopback for a local server, otherwise the interface this host
    reaches the server through (a UDP socket's local end: nothing is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def server_methods(owner: type, timeout: float) -> list[tuple[type, str, Any]]:
    """``(owner, name, drop-in)`` for ``VLLMGeneration``'s ``_init_vllm`` and ``sync_weights``, calling the class's
    current ones in colocate mode; none where they are wrapkit's already (patching twice is a no-op)."""
    names = ("_init_vllm", "sync_weights")
    if any(getattr(owner.__dict__.get(name), "wrapkit_server", False) for name in names):
        return []
    server = ServerSync({name: owner.__dict__[name] for name in names}, timeout)

    def _init_vllm(self: Any) -> None:
        server.init_vllm(self)

    def sync_weights(self: Any) -> None:
        server.sync_weights(self)

    for method in (_init_vllm, sync_weights):
        method.__doc__ = owner.__dict__[method.__name__].__doc__
        method.wrapkit_server = True  # type: ignore[attr-defined]
    return [(owner, "_init_vllm", _init_vllm), (owner, "sync_weights", sync_weights)]

