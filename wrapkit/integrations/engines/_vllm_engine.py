"""vLLM servers in other processes (vLLM 0.32 and 0.33's HTTP routes): full weights over its weight-transfer wire
(``connect`` / ``sync``, one server), and a new LoRA adapter on each ``sync_adapters``.

vLLM takes adapters from files only (``/v1/load_lora_adapter`` with a path; no tensors over the wire), with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` set on the server. Each replica is its own server and is told alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._errors import ArgumentError
from ._adapters import AdapterFiles, AdapterSync, Versions, check_arguments, sync_adapters
from ._engine_wire import EngineSync, connection_problem, request, said
from ._vllm_dense import DenseSender
from ._vllm_source import ParamMeta, wire_order
from ._vllm_sparse import send_patches as sparse_send

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """vLLM servers at ``url`` (one url per data-parallel replica, each a server of its own).

    ``timeout``: seconds for each call to a server and, for ``sync``, each broadcast. ``src_rank``: the trainer
    rank that talks to the servers (a global rank); every other rank only drives the gathers (or takes part in
    the collective save) and learns the outcome.

    For ``connect`` / ``sync`` (one server, started with ``--weight-transfer-config '{"backend":"nccl"}'`` and
    ``VLLM_SERVER_DEV_MODE=1``): ``master_address`` / ``master_port``, where the sending rank hosts the transfer
    group's rendezvous (the server's workers connect there); ``engine_ranks``, the server's workers (data x
    tensor x pipeline parallel size); ``backend``, ``"nccl"`` (vLLM's own communicator, vLLM installed beside
    the trainer) or ``"gloo"`` (a torch gloo group: vLLM has none; for receivers that speak it); ``buffer_bytes``,
    the packed chunk size both ends cut the stream at.
    """

    def __init__(self, url: str | Sequence[str], *, timeout: float = 120.0, src_rank: int = 0,
                 master_port: int | None = None, master_address: str = "127.0.0.1", engine_ranks: int = 1,
                 backend: str = "nccl", buffer_bytes: int = 2**30) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        if not self.urls or not all(isinstance(u, str) and u for u in self.urls):
            raise ArgumentError(f"VLLMEngine(): url={url!r}: pass the url of each replica's server")
        problem = _problem(timeout, master_port, engine_ranks, backend, buffer_bytes)
        if problem is not None:
            raise ArgumentError(f"VLLMEngine(): {problem}")
        self.timeout, self.src_rank = float(timeout), src_rank
        self._versions = Versions()
        self._dense = DenseSender(self.urls[0], master_address, master_port or 0, engine_ranks, backend,
                                  buffer_bytes, self.timeout, src_rank)

    def connect(self) -> None:
        """Join the server's weight-transfer group as its rank 0 (on every trainer rank; the sending rank joins,
        the others learn the outcome).

        :raises EngineError: on every rank where the server runs a vLLM before 0.32 (a wire not checked), refused,
            or its workers did not join within the timeout.
        :raises ArgumentError: without ``master_port`` or with more than one url.
        """
        if self._dense.port == 0 or len(self.urls) != 1:
            raise ArgumentError("VLLMEngine.connect(): the weight transfer needs master_port= and one server (its "
                                f"data-parallel replicas share one group); got master_port={self._dense.port or None} "
                                f"and {len(self.urls)} urls")
        self._dense.connect()

    def sync(self, wm: Any, *, bucket_bytes: int = 512 * 2**20, dtype: torch.dtype | None = None,
             merge_adapters: bool = False, keep_dtype: Callable[[str], bool] | None = None,
             pause: bool = True) -> EngineSync:
        """Send ``wm``'s full weights in the Hub's layout (``stream_full_parameters`` with the same
        ``bucket_bytes``, ``dtype``, ``merge_adapters`` and ``keep_dtype``, in ``weight_source``'s order) as one
        update session. Every trainer rank calls it. ``pause``: the server pauses generation (``mode=keep``:
        requests in flight wait) for the update and resumes after. The first sync of a model reads its metadata
        with one pass of the stream. Returns what was sent, the same on every rank; ``version`` is the weight
        version the server reported holding after it.

        :raises EngineError: on every rank, quoting the server, where it refused or failed a step, did not
            answer or receive within the timeout, or did not report this update's version after it. A sync
            whose chunks did not all arrive also drops the transfer group: ``connect()`` again.
        :raises ArgumentError: before ``connect()``.
        :raises UnsupportedModelError: for a model held by some of the job's ranks only.
        """
        return self._dense.sync(wm, bucket_bytes, dtype, merge_adapters, keep_dtype, pause)

    def send_patches(self, patches: list[Any]) -> None:
        """Send a ``DeltaSync`` round's sparse patches to a server whose weight-transfer backend is wrapkit's
        ``sparse_gloo`` (``delta.send(engine)`` on every rank calls it on the sending rank; named apart from
        ``send_weights``, which TRL's and vLLM's transfer protocols give a full stream): positions and values
        over the group ``connect()`` joined, applied in place by the server, which is paused meanwhile.

        :raises EngineError: quoting the server, where it refused or did not answer (``DeltaSync`` raises it on
            every rank; its next round is dense). Where the group fell out of step it is left: ``connect()``
            again on every rank.
        """
        sparse_send(self._dense, patches)

    # -- TRL's ``WeightTransferProtocol``: its async trainers call these on their main process alone ------------
    takes_weight_source = True  # send_weights() reads a weight source's own metadata (patch_trl's async sync)

    def init_weight_transfer(self) -> None:
        """Join the server's transfer group from this rank alone (TRL's async trainers call it on their main
        process at the start of training; a trainer of its own calls ``connect()`` on every rank instead).

        :raises EngineError: the server refused, or its workers did not join within the timeout.
        """
        self._dense.join_alone()

    def pause(self) -> None:
        """Pause the server's generation (``mode=keep``: requests in flight wait), from this rank alone."""
        self._dense._pause()

    def send_weights(self, iterator: Any) -> None:
        """Send ``(name, tensor)`` pairs as one update session from this rank alone, the other ranks feeding
        their part of the gathers behind ``iterator`` themselves (TRL's async trainers). The server loads and
        reports the session's weight version, which is checked, and its prefix cache is reset.

        ``iterator``: a ``weight_source(wm)`` (what ``patch_trl()`` hands its async trainers: the Hub's layout,
        LoRA merged without touching the live weights), whose metadata is the stream's; or any iterator of
        ``(name, tensor)``, which is then taken whole first (its names, dtypes and shapes are announced before
        the first byte), costing a full copy of the model's tensors on this rank.

        :raises EngineError: the server refused, failed or did not answer within the timeout; the iterator is
            read to its end either way, so that the other ranks' gathers are matched.
        """
        meta = getattr(iterator, "metadata", None)
        if meta is not None:
            self._dense.send_alone(iter(iterator), list(meta))
            return
        pairs = {name: tensor.detach() for name, tensor in iterator}
        if not pairs:
            raise ArgumentError("VLLMEngine.send_weights(): the iterator gave no tensors; the server would be told "
                                "of no weights and keep its own")
        order = wire_order([(name, tuple(t.shape), t.dtype) for name, t in pairs.items()])
        self._dense.send_alone(((name, pairs[name]) for name, _, _ in order),
                               [ParamMeta(name, dtype, shape) for name, shape, dtype in order])

    def resume(self) -> None:
        """Let the server generate again, from this rank alone.

        :raises EngineError: the server refused or did not answer.
        """
        self._dense._expect(self._dense._call("resume", {}), "resume")

    def destroy(self) -> None:
        """``close()`` (TRL's name, called at the end of training)."""
        self.close()

    @property
    def connected(self) -> bool:
        """Whether the transfer group is joined: False before ``connect()`` and after a sync that dropped it (then
        ``connect()`` again, on every rank)."""
        return self._dense.connected

    def close(self) -> None:
        """Leave the transfer group (the server's side is closed by its ``/shutdown_weight_transfer_engine``)."""
        self._dense.close()

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
        return None if status == 200 else said(answer, status)

    def unload(self, url: str, served: str) -> str | None:
        status, answer = request(url, "v1/unload_lora_adapter", {"lora_name": served}, self.timeout)
        return None if status == 200 else said(answer, status)


def _problem(timeout: object, port: object, engine_ranks: object, backend: object, buffer: object) -> str | None:
    def positive(v: object) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0

    problem = connection_problem(timeout, port)
    if problem is not None:
        return problem
    if not positive(engine_ranks) or not isinstance(engine_ranks, int):
        return f"engine_ranks={engine_ranks!r}: pass the server's worker count (data x tensor x pipeline size)"
    if backend not in ("nccl", "gloo"):
        return f"backend={backend!r}: pass 'nccl' (vLLM's own communicator) or 'gloo'"
    if not positive(buffer) or not isinstance(buffer, int):
        return f"buffer_bytes={buffer!r}: pass a positive int (bytes)"
    return None
