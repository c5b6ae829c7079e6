"""Full weights to a vLLM server in another process, sent by wrapkit on vLLM's weight-transfer wire (0.32, 0.33).

vLLM's own trainer-side sender (``NCCLTrainerWeightTransferEngine``) waits in its broadcast without a timeout and
does not look at what the server did with the weights. This sender speaks the same protocol (the server's
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` routes,
``VLLM_SERVER_DEV_MODE=1``; the packed wire: tensors back to back as bytes in the metadata's order, a chunk
closed right after the tensor that takes it past the buffer size, one broadcast per chunk), and adds what the
trainer needs around it:

- every HTTP call and every broadcast has a timeout, and the outcome is agreed by every trainer rank, so an
  engine that refuses or dies makes every rank raise ``EngineError`` within it;
- each chunk is broadcast, and waited for, before the stream gives the next tensor: the gathers that feed the
  stream and the sends to the engine never interleave;
- success is checked: the worker's ``update_weights`` call must return (it returns once every declared chunk
  arrived and was loaded), the session is finished under a weight version of its own, and the server must report
  that version back (``/weight_info``).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ..._errors import ArgumentError, EngineError, first_few
from ._engine_wire import (
    EngineSync,
    agree,
    answer_of,
    in_thread,
    join_beside,
    on_sender,
    rank,
    refuse_partial,
    request,
    said,
    share,
    why,
)
from ._vllm_source import HubSource, weight_source
from ._vllm_wire import Wire

__all__ = ["DenseSender", "OLDEST_WIRE"]

# The oldest vLLM release whose dense weight-transfer wire is this one: 0.32's routes, init info, update info, bodies
# and chunk cut were read in its source and driven by a real 0.32 server (the CPU build); 0.33 is the same.
OLDEST_WIRE = (0, 32)



def _explained(error: str | None, loading: list[str]) -> str | None:
    """``error``, and where the server gave no reason (vLLM passes a worker's error on as ``str(exc)``, empty for a
    bare assertion such as a shape that does not fit), where the reason is and what the workers were loading."""
    if error is None or ("error ''" not in error and not error.rstrip().endswith(":")):
        return error
    shown = first_few(loading, 4) or "none yet"
    return (f"{error} (vLLM passed on no reason: an error without a message, such as a failed assertion; the "
            f"server's log has it. The workers were loading the last chunk sent: {shown})")


class DenseSender:
    """The trainer side of vLLM's dense weight transfer for one server (see ``VLLMEngine.connect`` / ``sync``)."""

    def __init__(self, url: str, address: str, port: int, engine_ranks: int, backend: str, buffer_bytes: int,
                 timeout: float, src_rank: int) -> None:
        self.url, self.address, self.port, self.engine_ranks = url, address, port, engine_ranks
        self.backend, self.buffer_bytes, self.timeout, self.src_rank = backend, buffer_bytes, timeout, src_rank
        self.wire: Wire | None = None
        self.connected = False  # on every rank: the group was joined, and not dropped since
        self.broken = False
        self.syncs = 0
        self._tag = uuid.uuid4().hex[:8]
        self._source: tuple[tuple[Any, ...], HubSource] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def connect(self) -> None:
        joined, error = on_sender(self.src_rank, self._join)
        self.wire = joined if joined is not None else self.wire
        self._agreed(error, "connect")
        self.connected = True

    def _join(self) -> Wire:
        _, answer = request(self.url, "version", None, self.timeout, method="GET")
        version = str(answer.get("version", ""))
        found = re.match(r"(\d+)\.(\d+)", version)
        if found is None or (int(found[1]), int(found[2])) < OLDEST_WIRE:
            raise EngineError(f"the server runs vLLM {version or '(no /version answer)'}; VLLMEngine.sync() speaks the "
                              "weight-transfer wire checked against vLLM 0.32 and 0.33 (the routes, the init and "
                              "update bodies, the packed chunk cut), and releases before 0.32 were not checked: use "
                              "vLLM 0.32 or later, or pass weight_source(wm) to that release's own "
                              "trainer_init(..., source=...)")
        world = 1 + self.engine_ranks
        init_info = {"master_address": self.address, "master_port": self.port, "rank_offset": 1,
                     "world_size": world, "packed": True, "packed_buffer_size_bytes": self.buffer_bytes,
                     "packed_num_buffers": 2}

        def init() -> str | None:
            status, answer = self._call("init_weight_transfer_engine", {"init_info": init_info})
            return None if status == 200 else f"init_weight_transfer_engine was refused: {said(answer, status)}"

        wire: Wire = join_beside(lambda: Wire(self.backend, self.address, self.port, world, self.timeout), init,
                                  self.timeout)
        return wire

    def join_alone(self) -> None:
        """Join the transfer group from this rank alone (TRL's transfer protocol calls it on its main process)."""
        try:
            self.wire = self._join()
        except Exception as exc:
            raise EngineError(f"VLLMEngine.init_weight_transfer() at {self.url}: {why(exc)}") from exc
        self.connected = True

    def close(self) -> None:
        if self.wire is not None:
            self.wire.close()
        self.wire, self.connected = None, False

    # -- one update -----------------------------------------------------------------------------
    def sync(self, wm: Any, bucket_bytes: int, dtype: torch.dtype | None, merge_adapters: bool,
             keep_dtype: Callable[[str], bool] | None, pause: bool) -> EngineSync:
        refuse_partial(wm, "VLLMEngine.sync()", "a sync is agreed over every rank of the job")
        if "peft" in wm.stack and not merge_adapters:
            # Unmerged, the stream is the PEFT model's own (base_model.model..., lora_A/lora_B), which no model
            # vLLM serves has: refused here, before the server is paused, rather than by its loader mid-update.
            raise ArgumentError(f"VLLMEngine.sync(): this {wm.backend} model has PEFT adapters, and "
                                "merge_adapters=False would send them unmerged under PEFT's names "
                                "(base_model.model.*, lora_A/lora_B), which the served model does not have: pass "
                                "merge_adapters=True to send the weights with the adapters merged, or serve them as "
                                "a LoRA with sync_adapters()")
        if not self.connected:
            raise ArgumentError("VLLMEngine.sync() before connect(): call connect() on every rank first (again "
                                "after a sync that left the transfer group out of step)")
        t0 = time.perf_counter()
        source = self._source_of(wm, bucket_bytes, dtype, merge_adapters, keep_dtype)
        meta = source.metadata  # the first use is a pass of the stream on every rank
        # A generator; off the sending rank this only drives the gathers.
        error, tensors, chunks, moved, version = self._session(meta, source.iter_full(), rank() == self.src_rank,
                                                               pause, lambda: source.last_error)
        self._agreed(error, "sync")
        tensors, chunks, moved, version = share((tensors, chunks, moved, version), self.src_rank)
        return EngineSync(tensors, chunks, moved, time.perf_counter() - t0, [], version)

    def send_alone(self, pairs: Any, meta: list[Any]) -> int:
        """One update session of ``pairs`` (an iterator of ``meta``'s tensors, in its order) from this rank alone,
        with no pause or resume and no agreement (TRL's transfer protocol: the other ranks drive the gathers that
        feed ``pairs`` themselves). Returns the tensors sent; raises ``EngineError`` here."""
        if self.wire is None:
            raise ArgumentError("VLLMEngine.send_weights() before init_weight_transfer() (or connect())")
        error, tensors, _, _, _ = self._session(meta, pairs, True, False, lambda: None)
        if error is not None:
            if self.broken:
                self.close()
            raise EngineError(f"VLLMEngine.send_weights() at {self.url}: {error}")
        return tensors

    def _session(self, meta: list[Any], pairs: Any, sends: bool, pause: bool,
                 late_error: Callable[[], str | None]) -> tuple[str | None, int, int, int, str]:
        """Pause (``pause``), start, ``update_weights`` answered in a thread while the chunks are broadcast, and
        ``_end`` on the sending rank; elsewhere ``pairs`` is only read to its end. ``late_error``: an error the
        iterator records once read to its end. Returns the error, tensors, chunks, bytes and the version."""
        self.syncs += 1
        version = f"wrapkit-{self._tag}-{self.syncs}"
        error, box, thread, paused = None, None, None, False
        if sends:
            try:
                paused = pause and self._pause()
                self._expect(self._call("start_weight_update", {}), "start_weight_update")
                info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).removeprefix("torch.")
                                                                          for m in meta],
                        "shapes": [list(m.shape) for m in meta]}  # always whole: empty lists load nothing
                box, thread = in_thread(lambda: self._call("update_weights", {"update_info": info}))
            except Exception as exc:
                error = why(exc)
        tensors = chunks = moved = 0
        loading: list[str] = []  # the names of the last chunk sent: what the workers were loading
        try:
            parts: list[torch.Tensor] = []
            names: list[str] = []
            size = 0
            for name, tensor in pairs:
                if error is not None or box is None:
                    break
                parts.append(tensor.contiguous().view(-1).view(torch.uint8))
                names.append(name)
                size += parts[-1].numel()
                tensors += 1
                if size > self.buffer_bytes or tensors == len(meta):  # vLLM's cut, on both ends
                    error = self._send(parts, box)
                    loading = names if error is None else loading  # a refused send: the workers load the one before
                    chunks, moved, parts, names, size = chunks + 1, moved + size, [], [], 0
        finally:
            # A sender that stopped early: the rest is read to its end, so that the gathers feeding it are matched
            # (a weight source's generator does so when closed).
            if hasattr(pairs, "close"):
                pairs.close()
            else:
                for _ in pairs:
                    pass
        error = error or late_error()
        if sends:
            error = self._end(error, box, thread, version, paused, tensors, len(meta), loading)
        return error, tensors, chunks, moved, version

    def _source_of(self, wm: Any, bucket_bytes: int, dtype: torch.dtype | None, merge_adapters: bool,
                   keep_dtype: Callable[[str], bool] | None) -> HubSource:
        """One weight source per model and stream arguments, so the metadata pass is made once."""
        key = (id(wm), bucket_bytes, dtype, merge_adapters, keep_dtype)
        if self._source is None or self._source[0] != key:
            source = weight_source(wm, bucket_bytes=bucket_bytes, dtype=dtype, merge_adapters=merge_adapters,
                                   keep_dtype=keep_dtype, src_rank=self.src_rank)
            source.raises = False  # its outcome joins this sync's, agreed once below
            self._source = (key, source)
        return self._source[1]

    def _send(self, parts: list[torch.Tensor], box: dict[str, Any]) -> str | None:
        refused = _answered(box)
        if refused is not None:  # answered before its chunks were sent: the workers are not receiving
            self.broken = True  # chunks sent before the answer may wait unread on the wire
            return refused
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        assert self.wire is not None
        try:
            refused = self.wire.broadcast(flat, lambda: _answered(box, refusals_only=True))
        except Exception as exc:  # the workers never took their part (or are gone): out of step
            self.broken = True
            return f"sending {flat.numel()} bytes failed: {why(exc)}; the transfer group is out of step"
        if refused is not None:  # answered while this chunk waited for its receiver, which is gone
            self.broken = True
        return refused

    def _end(self, error: str | None, box: dict[str, Any] | None, thread: Any, version: str, paused: bool,
             sent: int, declared: int, loading: list[str]) -> str | None:
        """Wait for the workers' answer, finish the session, check the version the server then reports, and
        let generation go on (also after a failure that came before the update began; one after leaves the server
        paused)."""
        try:
            if thread is not None:
                thread.join(1.0 if self.broken else self.timeout)  # out of step: the workers wait for chunks
                if thread.is_alive():
                    self.broken = True
                    error = error or f"update_weights did not answer within {self.timeout:.0f} s"
                elif error is None:
                    error = _answered(box or {}, refusals_only=True)
            if error is None and sent != declared:
                error = f"{sent} of the {declared} tensors declared were sent"
            if error is None:
                self._expect(self._call("finish_weight_update", {"weight_version": version}), "finish_weight_update")
                _, answer = request(self.url, "weight_info", None, self.timeout, method="GET")
                if answer.get("weight_version") != version:
                    error = (f"after the update the server reports weight version {answer.get('weight_version')!r}, "
                             f"not {version!r}: it did not finish this update")
            if error is None:
                # Paused with mode=keep, vLLM keeps its prefix cache: blocks computed with the previous weights
                # would serve prompts that share a prefix with earlier ones. Requests held over are recomputed.
                _, answer = self._call("reset_prefix_cache?reset_running_requests=true", {})
                if answer.get("success") is not True:
                    error = ("the weights are this update's, but the server did not reset its prefix cache "
                             f"(answer {answer!r}), so cached blocks of the previous weights may be served")
        except Exception as exc:
            error = error or why(exc)
        error = _explained(error, loading)
        if paused and error is not None and box is not None:
            # The workers may have loaded part of this update: generating from such a model is wrong, or crashes
            # the engine (vLLM leaves unfinished layers on the meta device). The next sync resumes it.
            if _status(box)[0] == 0:  # the update got no answer: the server may be gone rather than paused
                return (f"{error}; the server may be down (its log says why): once it serves again, connect() "
                        "on every rank and sync (a restarted server holds its checkpoint's weights); if it is up, "
                        "it is left paused, since its weights may be partly this update's, until the next sync")
            return (f"{error}; the server is left paused, since its weights may be partly this update's: sync "
                    "again (the next sync resumes it), or POST /resume to serve what it holds")
        if paused:
            try:
                self._expect(self._call("resume", {}), "resume")
            except Exception as exc:
                error = error or why(exc)
        return error

    # -- the control plane ------------------------------------------------------------------------
    def _call(self, route: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return request(self.url, route, payload, self.timeout)

    def _pause(self) -> bool:
        # "keep": requests in flight are frozen in the queue and go on after /resume (nothing is aborted).
        self._expect(self._call("pause?mode=keep", {}), "pause")
        return True

    @staticmethod
    def _expect(reply: tuple[int, dict[str, Any]], route: str) -> None:
        if reply[0] != 200:
            raise EngineError(f"{route} was refused: {said(reply[1], reply[0])}")

    def _agreed(self, error: str | None, what: str) -> None:
        """Every trainer rank learns the sending rank's outcome and raises alike. Where the transfer group fell out
        of step every rank drops it, so that each needs ``connect()`` again, together."""
        error = agree(error, self.broken, self.src_rank, self.close)
        self.broken = False
        if error is not None:
            raise EngineError(f"VLLMEngine.{what}() at {self.url}: {error}")


def _answered(box: dict[str, Any], refusals_only: bool = False) -> str | None:
    """What the engine said, where its ``update_weights`` call already returned: before a chunk is sent, any
    answer means the workers stopped receiving. While a chunk is on its way a success may come (the last chunk
    arrived and was loaded before this rank saw its send complete): then only a refusal counts."""
    if "error" not in box and "value" not in box:
        return None
    status, answer = _status(box)
    if refusals_only and status == 200:
        return None
    if status == 0:  # no HTTP answer at all: the server closed the connection, or is gone
        return f"update_weights got no answer: {said(answer, status)}"
    return f"update_weights was refused: {said(answer, status)}"




def _status(box: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """An ``in_thread`` box of ``request`` as ``(status, answer)``; a call that failed or still waits reads as 0."""
    if "value" in box:
        status, answer = box["value"]
        return int(status), dict(answer)
    return 0, answer_of(box)
