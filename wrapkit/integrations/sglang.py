"""Weights to an SGLang server in another process (SGLang 0.5.23's distributed update), from any backend.

Every trainer rank calls ``connect()`` and ``sync(wm)`` alike. The sending rank joins the engine's weight-update
group as its rank 0; the other ranks only drive the gathers. A sync is one update session:
``pause_generation``, ``begin_weight_update``, one ``update_weights_from_distributed`` per bucket in the
``flattened_bucket`` format, ``end_weight_update``, ``continue_generation``. Each bucket is gathered, then sent,
then the next is gathered: gathers and sends never interleave. Every engine call has a timeout, and the
outcome is agreed by every trainer rank before ``sync`` returns or raises, so no rank is left in a collective.
"""

from __future__ import annotations

import base64
import hashlib
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._errors import ArgumentError, EngineError
from .._results import Bucket, entry_bytes
from ..base.process_groups import join_weight_group
from .engines._adapters import AdapterFiles, AdapterSync, Versions, check_arguments, sync_adapters, temporary_root
from .engines._engine_wire import (
    EngineSync,
    agree,
    answer_of,
    call,
    connection_problem,
    in_thread,
    join_beside,
    on_sender,
    rank,
    refuse_partial,
    said,
    share,
    why,
)

__all__ = ["SGLangEngine", "EngineSync", "AdapterSync", "flattened_bucket"]


def flattened_bucket(bucket: Bucket) -> tuple[torch.Tensor, list[str], list[str], list[list[int]]]:
    """``bucket`` as SGLang's ``flattened_bucket`` load format reads it: its tensors back to back with no
    padding, ordered by falling itemsize (the receiver rebuilds the offsets from the metadata and refuses a
    tensor whose offset is not a multiple of its itemsize). Returns the bytes, names, dtypes and shapes."""
    entries = sorted(bucket.entries, key=lambda e: -e.dtype.itemsize)  # stable: the bucket's order within a size
    flat = torch.empty(sum(entry_bytes(e) for e in entries), dtype=torch.uint8, device=bucket.flat.device)
    at = 0
    for e in entries:
        n = entry_bytes(e)
        flat[at:at + n].copy_(bucket.flat[e.offset:e.offset + n])
        at += n
    return (flat, [e.name for e in entries], [str(e.dtype).removeprefix("torch.") for e in entries],
            [list(e.shape) for e in entries])


class SGLangEngine:
    """An SGLang server at ``url`` that takes weights over ``torch.distributed`` (``connect()``, ``sync()``), and
    LoRA adapters as tensors (``sync_adapters()``, where ``url`` may list one server per data-parallel replica).

    ``master_address`` / ``master_port``: where the sending rank hosts the weight-update group's store (the
    engine's workers connect there; needed by ``connect()`` only). ``engine_ranks``: the engine's tensor x
    pipeline size (one data-parallel replica: SGLang's distributed update takes no more). ``group_name``: torch
    registers group names process-wide, so a trainer that feeds two engines gives each its own. ``backend``:
    ``"nccl"`` on GPUs, ``"gloo"`` on CPUs. ``timeout``: seconds for each engine call and each collective of the
    group.
    ``src_rank``: the trainer rank that sends (a global rank). ``engine_ranks`` is also how many copies of an
    adapter's tensors a request carries (SGLang's tensor-parallel ranks each read their own).
    """

    def __init__(self, url: str | Sequence[str], *, master_port: int | None = None, master_address: str = "127.0.0.1",
                 engine_ranks: int = 1, group_name: str = "wrapkit-weights", backend: str = "gloo",
                 timeout: float = 120.0, src_rank: int = 0) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        problem = _problem(engine_ranks, group_name, backend, timeout, master_port)
        if not self.urls or not all(isinstance(u, str) and u for u in self.urls):
            problem = f"url={url!r}: pass the url of the server (of each replica's, for adapters)"
        if problem is not None:
            raise ArgumentError(f"SGLangEngine(): {problem}")
        self.url, self.master_address, self.master_port = self.urls[0], master_address, master_port
        self.engine_ranks, self.group_name, self.backend = engine_ranks, group_name, backend
        self.timeout, self.src_rank = timeout, src_rank
        self._group: Any = None
        self._connected = False
        self._broken = False  # set on the sending rank where the group fell out of step; agreed with the rest
        self._versions = Versions()
        self._adapter_root: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open the weight-update group (on every trainer rank). Raises ``EngineError`` on every rank where
        the engine refuses or does not join within the timeout."""
        if self.master_port is None or len(self.urls) != 1:
            raise ArgumentError("SGLangEngine.connect(): the distributed update needs master_port= and one server "
                                f"(SGLang takes it on one data-parallel replica); got master_port={self.master_port!r} "
                                f"and {len(self.urls)} urls")
        joined, error = on_sender(self.src_rank, self._join)
        self._group = joined if joined is not None else self._group
        self._raise_agreed(error, "connect")
        self._connected = True

    def close(self) -> None:
        """Leave the group (the engine's side is closed by its ``destroy_weights_update_group``)."""
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # already gone with its peers: nothing left to release
                pass
        self._group, self._connected = None, False

    # -- one update -----------------------------------------------------------------------------
    def sync(self, wm: Any, *, bucket_bytes: int = 512 * 2**20, dtype: torch.dtype | None = None,
             merge_adapters: bool = False, keep_dtype: Callable[[str], bool] | None = None,
             pause: bool = True) -> EngineSync:
        """Send ``wm``'s full weights in the Hub's layout (``stream_full_parameters`` with the same
        ``bucket_bytes``, ``dtype``, ``merge_adapters`` and ``keep_dtype``). Every trainer rank calls it.
        ``pause``: generation is paused (in-flight requests retracted) for the update and continued after.
        Raises ``EngineError`` on every rank if the engine refused or failed any step, quoting its answer."""
        refuse_partial(wm, "SGLangEngine.sync()", "a sync is agreed over every rank of the job")
        if not self._connected:
            raise ArgumentError("SGLangEngine.sync() before connect(): call connect() on every rank first")
        t0 = time.perf_counter()
        sends = self._sends()
        error = None
        if sends:
            try:
                error = self._begin(pause)
            except Exception as exc:
                error = why(exc)
        self._raise_agreed(error, "sync")
        sent: list[str] = []
        probes: dict[str, torch.Tensor] = {}
        moved = buckets = 0
        stream = wm.stream_full_parameters(bucket_bytes, dtype, merge_adapters, keep_dtype=keep_dtype,
                                           dst_rank=self.src_rank)
        for bucket in stream:  # off the sending rank this only drives the gathers
            if error is None:
                try:
                    names, n = self._send(bucket, probes)
                    sent += names
                    moved += n
                    buckets += 1
                except Exception as exc:  # the stream is still read to its end: the gathers stay matched
                    error = why(exc)
            del bucket
        verified: list[str] = []
        if sends:
            if error is None and not sent:
                error = "the model gave nothing to send: the engine's weights were not updated"
            try:
                error, verified = self._end(error, probes, pause)
            except Exception as exc:
                error = error or why(exc)
        self._raise_agreed(error, "sync")
        tensors, buckets, moved, verified = share((len(sent), buckets, moved, verified), self.src_rank)
        return EngineSync(tensors, buckets, moved, time.perf_counter() - t0, verified)

    # -- LoRA adapters alone ----------------------------------------------------------------------
    def sync_adapters(self, wm: Any, *, name: str = "policy", adapter_name: str | None = None,
                      keep: int = 1) -> AdapterSync:
        """Send ``wm``'s LoRA adapter (``adapter_name``, default: its single active one) to every server as a new
        version, ``{name}-v{N}``, as tensors (``load_lora_adapter_from_tensors``, with a SHA-256 per tensor that
        each engine rank checks before loading), and unload the versions beyond the last ``keep``. Every trainer
        rank calls it; no ``connect()`` is needed. The servers need ``--enable-lora`` and must be on the sending
        rank's host (the tensors travel in the request, but SGLang's loader is same-host only for other paths).
        The first sync goes on after the highest ``{name}-v{N}`` the servers already list. Returns what was done;
        its ``name`` is the ``model`` (or ``lora_path``) of a request. Raises ``EngineError`` on every rank where
        a server refused or did not answer (a version refused by one server is unloaded from the others)."""
        where = "SGLangEngine.sync_adapters()"
        check_arguments(self.urls, name, adapter_name, keep, where)
        if self._adapter_root is None:
            self._adapter_root = temporary_root(self.src_rank)
        return sync_adapters(wm, self, self.urls, self._versions, where, root=self._adapter_root, name=name,
                             adapter_name=adapter_name, keep=keep, src_rank=self.src_rank, timeout=self.timeout)

    reads_files = False  # the tensors travel in the request: a version's files go once it is loaded

    def load(self, url: str, served: str, files: AdapterFiles) -> str | None:
        tensors = {k: v.contiguous() for k, v in files.tensors.items()}
        # A plain pickle of CPU tensors (the storage's bytes inline) is what SGLang's restricted unpickler reads
        # from any process; one copy per tensor-parallel rank, each rank reading its own.
        payload = base64.b64encode(pickle.dumps(tensors)).decode()
        checksums = {k: hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                     for k, v in tensors.items()}
        answer = call(url, "load_lora_adapter_from_tensors",
                      {"lora_name": served, "config_dict": files.config, "pinned": False,
                       "serialized_named_tensors": [payload] * self.engine_ranks, "expected_checksums": checksums},
                      self.timeout)
        if _ok(answer):
            return None
        reason = str(answer.get("error_message") or said(answer))
        if "out of range" in reason:  # a tensor-parallel rank found no copy of its own
            reason += f" (one copy was sent per engine rank, engine_ranks={self.engine_ranks}: pass the server's " \
                      "tensor-parallel size as engine_ranks)"
        return reason

    def unload(self, url: str, served: str) -> str | None:
        answer = call(url, "unload_lora_adapter", {"lora_name": served}, self.timeout)
        return None if _ok(answer) else str(answer.get("error_message") or said(answer))

    # -- the sending rank -----------------------------------------------------------------------
    def _sends(self) -> bool:
        return rank() == self.src_rank

    def _call(self, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        return call(self.url, route, payload, self.timeout)

    def _join(self) -> Any:
        port = int(self.master_port or 0)  # connect() checked it is given
        payload = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                   "world_size": 1 + self.engine_ranks, "group_name": self.group_name, "backend": self.backend}

        def init() -> str | None:
            answer = self._call("init_weights_update_group", payload)
            return None if _ok(answer) else f"init_weights_update_group was refused: {said(answer)}"

        return join_beside(lambda: join_weight_group(self.master_address, port, 1 + self.engine_ranks, 0,
                                                     self.group_name, self.backend, self.timeout), init, self.timeout)

    def _begin(self, pause: bool) -> str | None:
        if pause:
            paused = self._call("pause_generation", {"mode": "retract"})
            if paused.get("status") != "ok":
                return f"pause_generation was refused: {said(paused)}"
        answer = self._call("begin_weight_update", {})
        return None if _ok(answer) else f"begin_weight_update was refused: {said(answer)}"

    def _send(self, bucket: Bucket, probes: dict[str, torch.Tensor]) -> tuple[list[str], int]:
        flat, names, dtypes, shapes = flattened_bucket(bucket)
        if not names:
            return [], 0
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                   "flush_cache": True, "load_format": "flattened_bucket"}
        box, thread = in_thread(lambda: self._call("update_weights_from_distributed", payload))
        try:
            dist.broadcast(flat, src=0, group=self._group)
        except Exception as exc:  # the group's timeout: the engine never took its part
            thread.join(self.timeout)
            self._broken = True
            raise EngineError(f"sending {len(names)} tensors ({names[0]}, ...) failed: {exc}; the engine "
                              f"answered: {said(answer_of(box))}. The group is out of step: connect() again") from exc
        thread.join(self.timeout)
        if thread.is_alive():
            self._broken = True
            raise EngineError(f"update_weights_from_distributed did not answer within {self.timeout:.0f} s after "
                              f"its {flat.numel()} bytes were sent")
        answer = answer_of(box)
        if not _ok(answer):
            raise EngineError(f"update_weights_from_distributed refused {len(names)} tensors ({names[0]}, ...): "
                              f"{said(answer)}")
        probes.update(_probes(dict(bucket.named_tensors()), names))
        return names, flat.numel()

    def _end(self, error: str | None, probes: dict[str, torch.Tensor], pause: bool) -> tuple[str | None, list[str]]:
        """Close the session (also after a failure: SGLang keeps it open otherwise), check what the engine
        holds, and let generation continue."""
        try:
            answer = self._call("end_weight_update", {})
            if error is None and not _ok(answer):
                error = f"end_weight_update was refused: {said(answer)}"
        except EngineError as exc:
            error = error or str(exc)
        verified: list[str] = []
        if error is None:
            error, verified = self._verify(probes)
        if pause:
            try:
                self._call("continue_generation", {})
            except EngineError as exc:
                error = error or str(exc)
        return error, verified

    def _verify(self, probes: dict[str, torch.Tensor]) -> tuple[str | None, list[str]]:
        verified: list[str] = []
        for name in probes:
            answer = self._call("get_weights_by_name", {"name": name, "truncate_size": 1})
            held = answer.get("value", answer.get("parameter"))
            if held is None:  # the engine's model cannot echo this name: nothing to compare
                continue
            if not _same(held, probes[name]):
                return (f"after the update the engine holds other values for {name} than were sent "
                        "(it loaded nothing, or something else, for it)"), verified
            verified.append(name)
        return None, verified

    def _raise_agreed(self, error: str | None, what: str) -> None:
        """Every trainer rank learns the sending rank's outcome, and raises alike. Where the group fell out of
        step every rank leaves it, so that each needs ``connect()`` again, together."""
        error = agree(error, self._broken, self.src_rank, self.close)
        self._broken = False
        if error is not None:
            raise EngineError(f"SGLangEngine.{what}() at {self.url}: {error}")


def _problem(engine_ranks: object, group_name: object, backend: object, timeout: object, port: object) -> str | None:
    if isinstance(engine_ranks, bool) or not isinstance(engine_ranks, int) or engine_ranks < 1:
        return f"engine_ranks={engine_ranks!r}: pass the engine's tensor x pipeline size (a positive int)"
    if not isinstance(group_name, str) or not group_name:
        return f"group_name={group_name!r}: pass a non-empty name (an empty one crashes the server)"
    if backend not in ("gloo", "nccl"):
        return f"backend={backend!r}: pass 'nccl' (GPUs) or 'gloo' (CPUs)"
    return connection_problem(timeout, port)


# SGLang's get_weights_by_name turns the whole tensor into a Python list before it cuts the first row: 2**18
# elements take it a few milliseconds, an embedding of a large vocabulary seconds and gigabytes.
PROBE_ELEMENTS = 2**18


def _probes(views: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The first row of the tensors a bucket's update is checked by, asked back once the session is closed: its
    first and last tensors, those of at most ``PROBE_ELEMENTS``; where neither is, its smallest one under it."""
    fits = [n for n in names if 0 < views[n].numel() <= PROBE_ELEMENTS and views[n].dim() >= 1]
    chosen = [n for n in dict.fromkeys((names[0], names[-1])) if n in fits]
    if not chosen and fits:
        chosen = [min(fits, key=lambda n: views[n].numel())]
    return {n: views[n][:1].detach().to("cpu", copy=True) for n in chosen}


def _ok(answer: dict[str, Any]) -> bool:
    return answer.get("success") is True


def _same(held: Any, sent: torch.Tensor) -> bool:
    """The engine's echo of a tensor's first row against what was sent: exactly, in float32, or after
    rounding to the half-precision dtype the engine may hold it in."""
    try:
        got = torch.tensor(held, dtype=torch.float32).flatten()
    except (TypeError, ValueError):
        return False
    want = sent.to(torch.float32).flatten()
    if got.numel() != want.numel():
        return False
    return any(torch.equal(got, want.to(d).to(torch.float32)) for d in (torch.float32, torch.bfloat16, torch.float16))
