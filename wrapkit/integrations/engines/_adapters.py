"""LoRA adapters alone to engines in other processes: a new name on each sync, every replica told, old versions
unloaded.

A merged sync sends the whole model where an adapter is megabytes. Engines serve an adapter by name and cache by
name (vLLM keys its prefix cache by it), so each sync loads the adapter under a new name, ``{name}-v{version}``, on
every replica, checks that every replica lists it, and then unloads the versions beyond ``keep``. The adapter is
saved collectively in PEFT's layout (``save_pretrained(adapters_only=True)``: every backend, pipeline stages and
LoRA on experts included); the sending rank talks to the engines; every rank learns the outcome and raises alike.
A replica that refuses the new version has it unloaded from the replicas that took it: they all go on serving
the previous one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..._errors import ArgumentError, EngineError
from ..._imports import require
from ._engine_wire import rank, refuse_partial, request, share

__all__ = ["AdapterSync", "AdapterFiles", "Versions", "sync_adapters", "listed", "temporary_root", "check_arguments"]


class AdapterSync(NamedTuple):
    """What one adapter sync did, the same on every trainer rank. ``name``: the version now served (the
    ``model`` of a request); ``unloaded``: the versions taken off every replica by this sync."""

    name: str
    version: int
    tensors: int
    bytes: int
    seconds: float
    replicas: int
    unloaded: list[str]


class AdapterFiles(NamedTuple):
    """One saved adapter, as the sending rank reads it back: its directory, PEFT config and tensors."""

    directory: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class Routes(Protocol):
    """One engine's adapter calls on one replica; each returns the engine's refusal, or None."""

    def load(self, url: str, served: str, files: AdapterFiles) -> str | None: ...

    def unload(self, url: str, served: str) -> str | None: ...

    @property
    def reads_files(self) -> bool:
        """Whether the engine reads a served version's files again later (vLLM re-reads an adapter its cache
        evicted); where it does not, they are removed once loaded."""


class Versions:
    """The versions an engine object has loaded, oldest first, and the next number: kept alike on every rank."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.next: int | None = None  # read from the engines on the first sync


def listed(url: str, timeout: float) -> set[str]:
    """The model names a replica serves (``GET /v1/models``: the base model and every loaded adapter)."""
    status, answer = request(url, "v1/models", None, timeout, method="GET")
    if status >= 400 or not isinstance(answer.get("data"), list):
        raise EngineError(f"{url}/v1/models did not list the served models: {answer.get('message', answer)}")
    return {str(card.get("id")) for card in answer["data"] if isinstance(card, dict)}


def check_arguments(urls: Sequence[str], name: object, adapter_name: object, keep: object, where: str) -> None:
    problem = None
    if not urls:
        problem = "no engine url: pass the url of every replica"
    elif not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        problem = f"name={name!r}: pass a non-empty name of letters, digits, '.', '_' or '-'"
    elif adapter_name is not None and not isinstance(adapter_name, str):
        problem = f"adapter_name={adapter_name!r}: pass the name of one of the model's adapters, or None"
    elif isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        problem = f"keep={keep!r}: pass how many versions each replica keeps loaded (1 or more)"
    if problem is not None:
        raise ArgumentError(f"{where}: {problem}")


def sync_adapters(wm: Any, routes: Routes, urls: Sequence[str], versions: Versions, where: str, *, root: str,
                  name: str, adapter_name: str | None, keep: int, src_rank: int, timeout: float) -> AdapterSync:
    """One adapter sync (see the module docstring). Each version is saved to ``root/{name}-v{version}`` (the
    same path on every rank, a directory the engines read where they load from files); the sending rank removes
    a version's files once it is unloaded, or was refused."""
    t0 = time.perf_counter()
    refuse_partial(wm, where, "an adapter sync is agreed over every rank of the job")
    adapter = _adapter(wm, adapter_name, where)
    sends = rank() == src_rank
    error: str | None = None
    if versions.next is None:  # the first sync goes on after the versions the engines already serve
        found: list[str] = []
        if sends:
            try:
                found = _earlier(urls, name, timeout)
            except EngineError as exc:
                error = str(exc)
        error, found = share((error, found), src_rank)
        _raise(error, where)
        versions.served = found
        versions.next = 1 + max((_number(v, name) for v in found), default=0)
    version = versions.next
    versions.next += 1
    served = f"{name}-v{version}"
    wm.save_pretrained(os.path.join(root, served), adapters_only=True, adapter_names=[adapter])  # raises alike
    result = AdapterSync(served, version, 0, 0, 0.0, len(urls), [])
    if sends:
        try:
            error, result = _load_everywhere(routes, urls, versions.served, root, keep, timeout, adapter, result)
        except Exception as exc:  # reading the saved files back: nothing was loaded anywhere
            error = f"{type(exc).__name__}: {exc}"
            _remove(root, served)
    error, agreed = share((error, result), src_rank)
    result = AdapterSync(*agreed)
    if error is None or result.tensors:  # a version loaded everywhere is served, even where an old one stayed
        versions.served = [v for v in versions.served if v not in result.unloaded] + [served]
    _raise(error, where)
    return AdapterSync(result.name, result.version, result.tensors, result.bytes, time.perf_counter() - t0,
                       result.replicas, result.unloaded)


def _load_everywhere(routes: Routes, urls: Sequence[str], before: list[str], root: str, keep: int, timeout: float,
                     adapter: str, result: AdapterSync) -> tuple[str | None, AdapterSync]:
    served = result.name
    files = _read(os.path.join(root, served), adapter)
    size = sum(t.numel() * t.element_size() for t in files.tensors.values())
    loaded: list[str] = []
    for url in urls:
        refusal = routes.load(url, served, files)
        if refusal is None and served not in listed(url, timeout):
            refusal = f"it answered success but does not list {served!r} among its models"
        if refusal is not None:
            undone = [u for u in loaded if routes.unload(u, served) is None]
            _remove(root, served)
            return (f"{url} did not load adapter version {served!r}: {refusal}. The {len(undone)} replica(s) that "
                    f"had loaded it unloaded it again; every replica serves {before[-1] if before else 'no'} "
                    "version as before"), result
        loaded.append(url)
    if not routes.reads_files:
        _remove(root, served)
    unloaded, stuck = [], []
    for old in (before + [served])[:-keep]:
        refusals = [f"{url}: {r}" for url in urls if (r := routes.unload(url, old)) is not None
                    and old in listed(url, timeout)]
        if refusals:
            stuck += refusals[:2]
        else:
            unloaded.append(old)
            _remove(root, old)
    result = AdapterSync(served, result.version, len(files.tensors), size, 0.0, result.replicas, unloaded)
    if stuck:
        return (f"version {served!r} is served by every replica, but older versions could not be unloaded: "
                + "; ".join(stuck) + ". They are tried again on the next sync"), result
    return None, result


def temporary_root(src_rank: int) -> str:
    """A directory made by the sending rank for versions the engine takes as tensors, its path on every rank."""
    return str(share(tempfile.mkdtemp(prefix="wrapkit-adapters-") if rank() == src_rank else "", src_rank))


def _remove(root: str, served: str) -> None:
    shutil.rmtree(os.path.join(root, served), ignore_errors=True)


def _read(path: str, adapter: str) -> AdapterFiles:
    from ...exchange.peft import adapter_dirs

    where = (adapter_dirs(path, adapter) or {}).get(adapter)
    if where is None:
        raise EngineError(f"the saved adapter {adapter!r} is not under {path!r} on the sending rank; the rank that "
                          "writes files and the sending rank must share this directory")
    st = require("safetensors.torch", feature="reading a saved adapter", extra="transformers")
    with open(os.path.join(where, "adapter_config.json")) as f:
        config = json.load(f)
    return AdapterFiles(where, config, st.load_file(os.path.join(where, "adapter_model.safetensors")))


def _adapter(wm: Any, adapter_name: str | None, where: str) -> str:
    """The adapter to send: the one named, else the model's single active adapter."""
    if adapter_name is not None:
        return adapter_name
    active = getattr(wm.unwrap(), "active_adapters", None)
    if not isinstance(active, list) or len(active) != 1:
        raise ArgumentError(f"{where}: the model has {'no PEFT adapter' if not active else f'adapters {active}'} "
                            "active; pass adapter_name= to say which adapter to send (a PEFT model is needed)")
    return str(active[0])


def _earlier(urls: Sequence[str], name: str, timeout: float) -> list[str]:
    held = {v for url in urls for v in listed(url, timeout) if _number(v, name)}
    return sorted(held, key=lambda v: _number(v, name))


def _number(served: str, name: str) -> int:
    match = re.fullmatch(re.escape(name) + r"-v(\d+)", served)
    return int(match.group(1)) if match else 0


def _raise(error: str | None, where: str) -> None:
    if error is not None:
        raise EngineError(f"{where}: {error}")
