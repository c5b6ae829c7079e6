"""vLLM's trainer-side ``WeightSource`` over a wrapped model, from any backend (vLLM 0.28-0.33).

vLLM's trainer engines (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``) read
a source's metadata once, tell the engine's workers the names, dtypes and shapes, and replay the source on
every ``send_weights()``, on every trainer rank; trainer rank 0 sends. This source declares the Hub's layout
(what vLLM's ``load_weights`` takes) and streams it with ``stream_full_parameters``: every rank drives the
gathers, only the sending rank gets tensors, so pipeline stages and expert shares reach it through the stream.

Two interfaces are served by one object: 0.28-0.32 call ``metadata()`` and iterate the source; 0.33 reads
``metadata`` as a cached property, ``owned_names(rank)`` and ``iter_full()``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import torch

from ..._errors import ArgumentError, EngineError
from ..._imports import is_available
from ..._results import Bucket
from ._engine_wire import rank, share, world_size

__all__ = ["ParamMeta", "weight_source", "vllm_interface", "wire_order"]


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """One tensor as the engine is told of it (vLLM's own ``ParamMeta`` where vLLM is installed): its Hub name,
    wire dtype and full shape; ``owners``: the trainer ranks that yield it (the sending rank alone)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)


class Metadata(list[Any]):
    """The metadata list, also callable: vLLM 0.28-0.32 call ``source.metadata()``, 0.33 reads
    ``source.metadata``."""

    def __call__(self) -> Metadata:
        return self


def vllm_interface() -> str | None:
    """The installed vLLM's ``WeightSource`` interface: ``"0.33"`` (``iter_full``), ``"0.28"`` (iteration,
    0.28-0.32), or None where vLLM (or its weight-transfer API, 0.28 and later) is not installed."""
    base = _vllm_base()
    if base is None:
        return None
    return "0.33" if hasattr(base.WeightSource, "iter_full") else "0.28"


def _vllm_base() -> Any:
    if not is_available("vllm"):
        return None
    try:
        return importlib.import_module("vllm.distributed.weight_transfer.base")
    except ImportError:  # before 0.28: no trainer-side weight transfer
        return None


class HubSource:
    """The weights of a wrapped model as vLLM's weight transfer takes them; build it with ``weight_source``."""

    def __init__(self, wm: Any, bucket_bytes: int, dtype: torch.dtype | None, merge_adapters: bool,
                 keep_dtype: Callable[[str], bool] | None, src_rank: int, param_meta: Any) -> None:
        self._wm, self._bucket_bytes, self._dtype = wm, bucket_bytes, dtype
        self._merge, self._keep, self._src = merge_adapters, keep_dtype, src_rank
        self._param_meta = param_meta
        self.last_error: str | None = None
        self.raises = True  # False: a pass that failed only records it (a driver that agrees outcomes itself)

    # -- what the engine is told, once --------------------------------------------------------
    @cached_property
    def metadata(self) -> Metadata:
        """Every tensor in the order ``iter_full`` gives it, the same on every rank: read from one pass of the
        stream (the sending rank gets its entries, the others drive the gathers), then broadcast from it."""
        entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for bucket in self._stream():
            entries += [(e.name, tuple(e.shape), e.dtype) for e in bucket.entries]
            del bucket
        entries = share(entries, self._src)
        if not entries:
            raise EngineError("weight_source(): the model gave nothing to send; the engine would be told of no "
                              "weights and keep its own")
        # 0.33 declares owners: only trainer rank 0 (the sender) yields tensors. 0.28-0.32 have no such field.
        owned = {"owners": (0,)} if "owners" in {f.name for f in dataclasses.fields(self._param_meta)} else {}
        return Metadata(self._param_meta(n, d, s, **owned) for n, s, d in wire_order(entries))

    def owned_names(self, rank: int) -> list[str]:
        """The names ``rank`` yields (vLLM 0.33): all on trainer rank 0, none elsewhere."""
        return [m.name for m in self.metadata] if rank == 0 else []

    def implements_iter_full(self) -> bool:
        return True

    def implements_iter_local(self) -> bool:
        return False

    # -- one pass, on every sync -----------------------------------------------------------------
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in ``metadata`` order on the sending rank, nothing on the others (which drive the
        gathers). At the end every rank learns whether the pass matched ``metadata`` and raises
        ``EngineError`` alike where it did not (a model whose parameters changed since the source was built)."""
        meta = self.metadata
        sends = rank() == self._src
        at, error = 0, None
        held: dict[str, torch.Tensor] = {}
        tail = {m.name for m in meta[_first_ragged(meta):]}
        consumer_left = False
        stream = self._stream()
        try:
            for bucket in stream:
                if not sends or error is not None:
                    continue
                for name, value in bucket.named_tensors():
                    if name in tail:  # yielded at the end (vLLM's packed chunks need it there, see wire_order)
                        held[name] = value.clone()
                        continue
                    error = _mismatch(meta, at, name, value)
                    if error is not None:
                        break
                    at += 1
                    yield name, value
                del bucket
            if sends and error is None:
                for m in meta[at:]:
                    if m.name not in held:
                        error = f"{m.name} was declared but the stream did not give it"
                        break
                    yield m.name, held.pop(m.name)
                    at += 1
        except GeneratorExit:  # the consumer closed this generator before its end
            consumer_left = True
            raise
        finally:
            # A consumer that stopped early (its send failed) closes this generator: the stream is still read to
            # its end, so that the other ranks' gathers are matched.
            for _ in stream:
                pass
            if consumer_left:  # the sender raises its consumer's own error; the other ranks raise this one
                # A consumer stops right after a send failed, and that send held at least the last tensor it took.
                error = error or (f"the engine's sender stopped (a send failed) after taking {at} of the "
                                  f"{len(meta)} tensors declared: at most {max(at - 1, 0)} reached the engine")
            elif sends and error is None and at != len(meta):
                error = f"the stream gave {at} of the {len(meta)} tensors declared"
            self._agree(error, raise_here=not consumer_left)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM 0.28-0.32 iterate the source itself."""
        return self.iter_full()

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError("wrapkit's weight source gives full tensors on the sending rank (iter_full)")

    # -- helpers --------------------------------------------------------------------------------------
    def _stream(self) -> Iterator[Bucket]:
        return iter(self._wm.stream_full_parameters(self._bucket_bytes, self._dtype, self._merge,
                                                    keep_dtype=self._keep, dst_rank=self._src))

    def _agree(self, error: str | None, raise_here: bool = True) -> None:
        error = share(error, self._src)
        self.last_error = error
        if error is not None and raise_here and self.raises:
            raise EngineError(f"weight source: {error}. Build a new weight_source() after changing the model")


def weight_source(wm: Any, *, bucket_bytes: int = 512 * 2**20, dtype: torch.dtype | None = None,
                  merge_adapters: bool = False, keep_dtype: Callable[[str], bool] | None = None,
                  src_rank: int = 0) -> Any:
    """A vLLM ``WeightSource`` over ``wm``, for vLLM's own trainer engines (``source=``), from any backend.

    Call it on every trainer rank alike. The tensors are ``wm.stream_full_parameters(bucket_bytes, dtype,
    merge_adapters, keep_dtype=keep_dtype)``'s, in the Hub's layout (experts per expert, each tied weight once).
    ``src_rank``: the global rank that is vLLM's trainer rank 0 (the sender); the others drive the gathers and
    yield nothing (their ``owned_names`` is empty).

    The metadata is read on first use (vLLM's ``trainer_init`` reads it) from one pass of the stream, so every
    rank must reach that first use. Its order is the stream's, except that a tensor whose byte size is not a
    multiple of the largest itemsize comes at the end, largest itemsize first: vLLM packs tensors back to back
    and views each at its offset in its dtype, so every tensor must start at a multiple of its itemsize however
    the chunks are cut. Where vLLM is installed the object is an instance of its ``WeightSource``; either
    interface (0.28-0.32: ``metadata()`` and iteration; 0.33: ``metadata``, ``owned_names``, ``iter_full``) is
    served. A pass that does not match the metadata raises ``EngineError`` on every rank.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ArgumentError(f"weight_source(bucket_bytes={bucket_bytes!r}): pass a positive int (bytes)")
    world = world_size()
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) or not 0 <= src_rank < world:
        raise ArgumentError(f"weight_source(src_rank={src_rank!r}): pass the global rank that sends, in "
                            f"0..{world - 1}")
    base = _vllm_base()
    if base is None:
        return HubSource(wm, bucket_bytes, dtype, merge_adapters, keep_dtype, src_rank, ParamMeta)
    cls = type("HubSource", (HubSource, base.WeightSource), {"__doc__": HubSource.__doc__})
    return cls(wm, bucket_bytes, dtype, merge_adapters, keep_dtype, src_rank, base.ParamMeta)


def wire_order(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[tuple[str, tuple[int, ...],
                                                                                         torch.dtype]]:
    """The stream's order, with every tensor whose byte size is not a multiple of the largest itemsize moved to
    the end, largest itemsize first. Then every tensor is preceded only by tensors whose sizes are multiples of
    its own itemsize (itemsizes are powers of two), so it is aligned wherever a chunk starts."""
    widest = max(d.itemsize for _, _, d in entries)
    tail = sorted((e for e in entries if _ragged(e[1], e[2], widest)), key=lambda e: -e[2].itemsize)
    return [e for e in entries if not _ragged(e[1], e[2], widest)] + tail


def _first_ragged(meta: list[Any]) -> int:
    """Where ``wire_order``'s tail starts in ``meta``."""
    widest = max(m.dtype.itemsize for m in meta)
    return next((i for i, m in enumerate(meta) if _ragged(m.shape, m.dtype, widest)), len(meta))


def _ragged(shape: tuple[int, ...], dtype: torch.dtype, widest: int) -> bool:
    """Whether a tensor's byte size is not a multiple of ``widest`` (the largest itemsize on the wire)."""
    return math.prod(shape) * dtype.itemsize % widest != 0


def _mismatch(meta: list[Any], at: int, name: str, value: torch.Tensor) -> str | None:
    if at >= len(meta):
        return f"the stream gave {name}, beyond the {len(meta)} tensors declared"
    m = meta[at]
    if m.name != name or m.dtype != value.dtype or tuple(m.shape) != tuple(value.shape):
        return (f"tensor {at} was declared {m.name} {m.dtype} {tuple(m.shape)} and came as {name} {value.dtype} "
                f"{tuple(value.shape)}")
    return None
