"""vLLM servers in other processes, told about a new LoRA adapter on each sync (vLLM 0.33's HTTP routes).

vLLM takes adapters from files only (``/v1/load_lora_adapter`` with a path; no tensors over the wire), with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` set on the server. Each replica is its own server and is told alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ArgumentError
from ._adapters import AdapterFiles, AdapterSync, Versions, check_arguments, sync_adapters
from ._engine_wire import request

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """vLLM servers at ``url`` (one url per data-parallel replica, each a server of its own).

    ``timeout``: seconds for each call to a server. ``src_rank``: the trainer rank that talks to the servers (a
    global rank); every other rank only takes part in the collective save and learns the outcome.
    """

    def __init__(self, url: str | Sequence[str], *, timeout: float = 120.0, src_rank: int = 0) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls or not all(isinstance(u, str) and u for u in self.urls):
            raise ArgumentError(f"VLLMEngine(): url={url!r}: pass the url of each replica's server")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ArgumentError(f"VLLMEngine(): timeout={timeout!r}: pass a positive number of seconds")
        self.timeout, self.src_rank = float(timeout), src_rank
        self._versions = Versions()

    def sync_adapters(self, wm: Any, directory: str, *, name: str = "policy", adapter_name: str | None = None,
                      keep: int = 1) -> AdapterSync:
        """Send ``wm``'s LoRA adapter (``adapter_name``, default: its single active one) to every replica as a new
        version, ``{name}-v{N}``, and unload the versions beyond the last ``keep``. Every trainer rank calls it.

        ``directory``: an existing directory that the servers can read at the same path (each version is saved
        to ``directory/{name}-v{N}`` and removed once unloaded). The first sync goes on after the highest
        ``{name}-v{N}`` the servers already list. Returns what was done; its ``name`` is the ``model`` to put in
        requests. Raises ``EngineError`` on every rank where a server refused or did not answer (a version
        refused by one replica is unloaded from the others, which go on serving the previous one), and
        ``ArgumentError`` / ``UnsupportedModelError`` for a model without that adapter.
        """
        where = "VLLMEngine.sync_adapters()"
        check_arguments(self.urls, name, adapter_name, keep, where)
        if not isinstance(directory, str) or not directory:
            raise ArgumentError(f"{where}: directory={directory!r}: pass a directory the servers read")
        return sync_adapters(wm, self, self.urls, self._versions, where, root=directory, name=name,
                             adapter_name=adapter_name, keep=keep, src_rank=self.src_rank, timeout=self.timeout)

    # -- one replica (the calls of ``_adapters.Routes``) -------------------------------------------
    reads_files = True  # an adapter evicted from vLLM's CPU cache is read from its path again

    def load(self, url: str, served: str, files: AdapterFiles) -> str | None:
        # LoRA on a mixture's fused 3-D experts (PEFT's target_parameters) is read in that layout only when asked.
        payload = {"lora_name": served, "lora_path": files.directory, "load_inplace": False,
                   "is_3d_lora_weight": bool(files.config.get("target_parameters"))}
        status, answer = request(url, "v1/load_lora_adapter", payload, self.timeout)
        return None if status == 200 else _said(status, answer)

    def unload(self, url: str, served: str) -> str | None:
        status, answer = request(url, "v1/unload_lora_adapter", {"lora_name": served}, self.timeout)
        return None if status == 200 else _said(status, answer)


def _said(status: int, answer: dict[str, Any]) -> str:
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {status}: {message or answer.get('message', answer)}"
