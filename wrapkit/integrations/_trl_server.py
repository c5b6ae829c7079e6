"""TRL's ``VLLMGeneration`` set-up and sync under ``patch_trl()``: server mode on wrapkit's ``VLLMEngine`` (asked for
with ``vllm_server=True``), and colocate mode on vLLM's CPU build.

TRL's ``VLLMGeneration`` in server mode joins the server's weight-transfer group through its own
``VLLMClient``: NCCL only (CUDA), no timeout on the transfer, and nothing checked after it. With
``vllm_server=True``, ``patch_trl()`` keeps TRL's client for generation and hands the weights to a
``VLLMEngine`` instead: every rank enters each sync together, the server is paused and resumed around
it, every step has a timeout, and the weight version the server reports afterwards is checked. The
transfer group is gloo on a CPU trainer (a server started with wrapkit's ``gloo`` backend) and vLLM's
NCCL on a GPU one. TRL's configuration is unchanged: ``vllm_server_base_url`` (or host and port),
``vllm_group_port`` and ``vllm_server_timeout`` are read from it.

In colocate mode TRL loads each tensor into its in-process engine with ``load_weights``, which vLLM's CPU build
cannot take after start-up (its linear layers keep only a packed copy) and whose mixtures' experts it leaves in
the wrong layout: ``colocated_cpu()`` before the engine is built, and the experts packed again after each sync.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from .._errors import EngineError
from ._trl_sync import prepared_policy

__all__ = ["Replaced", "ServerSync", "server_methods", "serving_engine", "colocated_cpu", "colocated_loaded"]

_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


class Replaced:
    """A trainer's methods ``patch_trl()`` wraps: TRL's own (``originals``), and what was asked of server mode
    (``server``: on wrapkit's engine; ``timeout``: each of its steps, seconds)."""

    def __init__(self, originals: dict[str, Any], timeout: float, server: bool) -> None:
        self.originals, self.timeout, self.server = originals, timeout, server

    def ask(self, timeout: float, server: bool) -> None:
        """A later ``patch_trl()`` call on methods already wrapped: server mode is turned on, if asked, until undone
        (never off), with that call's timeout."""
        self.server = self.server or server
        self.timeout = timeout if server else self.timeout


class ServerSync(Replaced):
    """The two ``VLLMGeneration`` methods ``patch_trl()`` wraps: server mode on wrapkit's engine where ``server`` is
    set; colocate mode on vLLM's CPU build made able to reload (``colocated_cpu``)."""

    def init_vllm(self, generation: Any) -> None:
        """Server mode with ``server``: TRL's client on the main process (for generation only: no NCCL
        communicator), and on every rank a ``VLLMEngine`` joined to the server's transfer group, as
        ``generation.wrapkit_engine``. Colocate mode: TRL's, after ``colocated_cpu()``."""
        if generation.mode == "colocate":
            colocated_cpu()
        if generation.mode != "server" or not self.server:
            self.originals["_init_vllm"](generation)
            return
        from trl.generation.vllm_client import VLLMClient

        url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"

        def client() -> None:
            generation.vllm_client = VLLMClient(base_url=url, group_port=generation.group_port,
                                                connection_timeout=generation.server_timeout)

        generation.wrapkit_engine = serving_engine(generation.accelerator, url, generation.group_port, self.timeout,
                                                   before=client)

    def sync_weights(self, generation: Any) -> None:
        """Server mode on wrapkit's engine: one checked update of the policy, read through its adapter in the Hub's
        layout (LoRA merged without touching the live weights), the server's prefix cache reset. Otherwise TRL's
        (its walk is wrapkit's stream), and in colocate mode on vLLM's CPU build the experts packed again."""
        engine = getattr(generation, "wrapkit_engine", None)
        if generation.mode != "server" or engine is None:
            self.originals["sync_weights"](generation)
            if generation.mode == "colocate":
                colocated_loaded(generation.llm.llm_engine.model_executor.driver_worker.model_runner.model)
            return
        wm = prepared_policy(generation.model, generation.accelerator)
        engine.sync(wm, merge_adapters="peft" in wm.stack)


def cpu_build() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def colocated_cpu() -> None:
    """Make engines built in this process from now on reloadable in place on vLLM's CPU build (a no-op elsewhere):
    its linear layers compute from their own weights (vLLM's ``F.linear`` fallback) instead of a copy packed at
    load, which leaves ``load_weights`` nothing to load into. The experts of a mixture are packed again after each
    sync (``colocated_loaded``). TRL's and ms-swift's colocate modes load into such an engine."""
    if cpu_build():
        from .engines.vllm_gloo import keep_cpu_weights

        keep_cpu_weights(everywhere=True)


def colocated_loaded(model: Any) -> None:
    """After a sync into an in-process engine's ``model`` (``colocated_cpu``): on vLLM's CPU build, a mixture's
    experts packed again (the build's reload leaves them in the checkpoint's layout); a no-op elsewhere."""
    if cpu_build():
        from .engines.vllm_gloo import repack_cpu_experts

        repack_cpu_experts(model)


def serving_engine(accelerator: Any, url: str, group_port: int, timeout: float,
                   before: Callable[[], None] | None = None) -> Any:
    """A ``VLLMEngine`` on every rank, joined to the transfer group of the server at ``url`` (``patch_trl(
    vllm_server=True)``): gloo from a CPU trainer, vLLM's NCCL from a GPU one. The main process asks the server its
    world size (after ``before``, TRL's client set up there); every rank learns the outcome, and all raise
    ``EngineError`` together where it failed."""
    from .engines._engine_wire import request, share
    from .engines._vllm_engine import VLLMEngine

    ranks: Any = None
    if accelerator.is_main_process:
        try:
            if before is not None:
                before()
            ranks = int(request(url, "get_world_size", None, timeout, method="GET")[1]["world_size"])
        except Exception as exc:  # learned by every rank below, not raised here alone
            ranks = f"{type(exc).__name__}: {exc}"
    ranks = share(ranks, 0)
    if not isinstance(ranks, int):
        raise EngineError(f"patch_trl(vllm_server=True): the vLLM server at {url} did not answer ({ranks}): "
                          "start it (vllm serve with VLLM_SERVER_DEV_MODE=1 and a --weight-transfer-config) "
                          "before the trainer, or raise vllm_server_timeout")
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    engine = VLLMEngine(url, timeout=timeout, master_port=group_port, master_address=_address_towards(url),
                        engine_ranks=ranks, backend=backend)
    engine.connect()
    accelerator.wait_for_everyone()
    return engine


def _address_towards(url: str) -> str:
    """This host's address as the server sees it: loopback for a local server, otherwise the interface this host
    reaches the server through (a UDP socket's local end: nothing is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def server_methods(owner: type, timeout: float, server: bool) -> list[tuple[type, str, Any]]:
    """``(owner, name, drop-in)`` for ``VLLMGeneration``'s ``_init_vllm`` and ``sync_weights``. Where they are
    wrapkit's already none (patching twice is a no-op), and ``server`` turns server mode on, if asked, until undone."""
    names = ("_init_vllm", "sync_weights")
    installed = getattr(owner.__dict__.get("_init_vllm"), "wrapkit_server", None)
    if installed is not None:
        installed.ask(timeout, server)
        return []
    sync = ServerSync({name: owner.__dict__[name] for name in names}, timeout, server)

    def _init_vllm(self: Any) -> None:
        sync.init_vllm(self)

    def sync_weights(self: Any) -> None:
        sync.sync_weights(self)

    for method in (_init_vllm, sync_weights):
        method.__doc__ = owner.__dict__[method.__name__].__doc__
        method.wrapkit_server = sync  # type: ignore[attr-defined]
    return [(owner, "_init_vllm", _init_vllm), (owner, "sync_weights", sync_weights)]

