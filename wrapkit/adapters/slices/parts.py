"""The parts of a Megatron-Core model: each tensor-parallel rank keeps its slice of a split parameter in a
plain tensor, marked with ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.

Megatron cuts a full parameter along ``partition_dim`` into ``stride * tp`` equal chunks and gives rank ``r``
chunks ``r, r + tp, ...``: with a stride of 2 (SwiGLU's ``linear_fc1``, gate rows then up rows) each rank holds
its gate rows, then its up rows. A full value is one all-gather over the tensor-parallel group, the chunks put
back in that order. Norms, biases of row-parallel layers and position embeddings carry no mark: every rank holds
them whole. Everything local (moving tensors, counting bytes) is the whole-tensor parts'.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._errors import UnsupportedModelError
from ..._gather import Bypass
from ...base.module_internals import assign_named
from ..core.parts import Parts, Piece, Written, copy_into
from ..core.whole import TorchStates, WholePlacement

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["TpSplit", "megatron_parts", "gather_together", "own_slice"]

Shape = tuple[int, ...]


class TpSplit:
    """How one parameter is split over ``size`` tensor-parallel ranks (``rank`` is this one's)."""

    def __init__(self, p: torch.Tensor, group: Any) -> None:
        self.dim = int(getattr(p, "partition_dim", 0))
        self.stride = int(getattr(p, "partition_stride", 1))
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @staticmethod
    def of(p: torch.Tensor, group: Any) -> TpSplit | None:
        """The split of ``p``, or None where every rank holds it whole."""
        if not getattr(p, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
            return None
        return TpSplit(p, group)

    def full_shape(self, local: torch.Tensor) -> Shape:
        shape = list(local.shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    def chunks(self, full: torch.Tensor) -> list[torch.Tensor]:
        """This rank's chunks of ``full``, in the order its slice holds them."""
        parts = full.chunk(self.stride * self.size, dim=self.dim)
        return list(parts[self.rank::self.size])

    def assemble(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full value from every rank's slice, in rank order."""
        per_rank = [s.chunk(self.stride, dim=self.dim) for s in slices]
        return torch.cat([per_rank[r][j] for j in range(self.stride) for r in range(self.size)], dim=self.dim)

    def row_pieces(self, name: str, local: torch.Tensor, full_shape: Shape) -> list[Piece]:
        """A split along the rows as pieces of the full value: chunk ``j`` of this rank's slice is full chunk
        ``j * size + rank``, a range of whole rows, so a load reads those rows alone."""
        per = local.shape[0] // self.stride
        row = math.prod(full_shape[1:])
        return [Piece(name, (j * self.size + self.rank) * per * row, per * row, full_shape,
                      copy_into(local[j * per:(j + 1) * per]), live=_reader(local[j * per:(j + 1) * per]))
                for j in range(self.stride)]

    def column_pieces(self, name: str, local: torch.Tensor, full_shape: Shape) -> list[Piece]:
        """A split along the columns (dim 1) as pieces: chunk ``j`` of this rank's slice is full columns chunk
        ``j * size + rank`` of every row, so a load reads those columns alone."""
        per = local.shape[1] // self.stride
        first = [(j * self.size + self.rank) * per for j in range(self.stride)]
        return [Piece(name, 0, math.prod(full_shape), full_shape, copy_into(local[:, j * per:(j + 1) * per]),
                      columns=(first[j], first[j] + per), box=((0, first[j]), (full_shape[0], per)),
                      live=_reader(local[:, j * per:(j + 1) * per])) for j in range(self.stride)]

    def writer(self, local: torch.Tensor, full_shape: Shape) -> Any:
        """A ``Piece.write`` taking this rank's chunks out of the full value."""
        def write(values: torch.Tensor) -> None:
            with torch.no_grad():
                local.copy_(torch.cat(self.chunks(values.reshape(full_shape)), dim=self.dim))
        return write


def own_slice(p: torch.Tensor, full: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of ``full``, the whole value of parameter ``p`` split over ``group`` (all of it where
    ``p`` is not split)."""
    split = TpSplit.of(p, group)
    if split is not None:
        full = torch.cat(split.chunks(full.reshape(split.full_shape(p))), dim=split.dim)
    return full.reshape(p.shape)


def gather_together(params: list[tuple[torch.Tensor, TpSplit]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, full value)`` for split parameters of one dtype over one group (one of them: ``one``; a
    stream's bucket: ``many``), in one all-gather of their slices laid end to end."""
    split = params[0][1]
    device = params[0][0].device
    # gloo moves CPU tensors only; NCCL moves them on the model's device.
    comm = torch.device("cpu") if dist.get_backend(split.group) == "gloo" else device
    sent = torch.cat([p.detach().reshape(-1).to(comm) for p, _ in params])
    received = [torch.empty_like(sent) for _ in range(split.size)]
    dist.all_gather(received, sent, group=split.group)
    at = 0
    for p, own in params:
        n = p.numel()
        yield p, own.assemble([r[at:at + n].view(p.shape) for r in received]).to(device)
        at += n


def megatron_parts(model: Adapter, tp_group: Any) -> Parts:
    weights = MegatronWeights(model, tp_group)
    return Parts(weights, MegatronGatherer(model, weights), WholePlacement(model), None, TorchStates())


class MegatronWeights:
    def __init__(self, model: Adapter, tp_group: Any) -> None:
        self.model, self.group = model, tp_group

    def split(self, p: torch.Tensor) -> TpSplit | None:
        return TpSplit.of(p, self.group)

    def global_numel(self, p: torch.Tensor) -> int:
        split = self.split(p)
        return p.numel() * (split.size if split is not None else 1)

    def full_shapes(self) -> dict[int, Shape]:
        out: dict[int, Shape] = {}
        for p in self.model._unique_parameters():
            split = self.split(p)
            if split is not None:
                out[id(p)] = split.full_shape(p)
        return out

    def count(self, trainable_only: bool) -> int:
        params = self.model._unique_parameters()
        return sum(self.global_numel(p) for p in params if p.requires_grad or not trainable_only)

    def param_shapes(self) -> dict[str, Shape]:
        full = self.full_shapes()
        return {name: full.get(id(p), tuple(p.shape)) for name, p in self.model.named_live(buffers=False)}

    def resident_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model._unique_parameters():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        return None  # never paired shard to shard: a copy goes through full values

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return None

    def pieces(self) -> list[Piece]:
        out: list[Piece] = []
        seen: set[int] = set()
        for name, p in self.model.named_live(buffers=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            split = self.split(p)
            if split is None:
                out.append(Piece(name, 0, p.numel(), tuple(p.shape), copy_into(p.data), live=_reader(p.data)))
                continue
            full = split.full_shape(p)
            if split.dim == 0:  # each of its chunks is a contiguous range of the flattened full value
                out.extend(split.row_pieces(name, p.data, full))
            elif split.dim == 1:  # each of its chunks is a block of columns
                out.extend(split.column_pieces(name, p.data, full))
            else:
                out.append(Piece(name, 0, self.global_numel(p), full, split.writer(p.data, full)))
        return out

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        return None  # the slices are all the model keeps (an optimizer's fp32 copies are its own)

    def write_values(self, values: Iterable[tuple[str, torch.Tensor]], alpha: float) -> None:
        """Each rank's slices (and buffers) from full values under the whole model's names, which every rank
        has (``alpha`` < 1: a moving average, on the slices alone); no collective. Names it lacks are skipped."""
        assign_named(dict(self.model.named_live()), values, alpha, self._own_part)

    def _own_part(self, dst: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return own_slice(dst, full, self.group)


class MegatronGatherer:
    def __init__(self, model: Adapter, weights: MegatronWeights) -> None:
        self.model, self.weights = model, weights

    def one(self, p: torch.Tensor) -> torch.Tensor:
        split = self.weights.split(p)
        return p.detach() if split is None else next(gather_together([(p, split)]))[1]

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        done: dict[int, torch.Tensor] = {}
        for name, p in self.model.named_live(buffers=False):
            if id(p) not in done:
                done[id(p)] = self.one(p)
            yield name, done[id(p)]

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        # Every parameter is split on its own, and any set of them goes in one collective (``many``).
        return [[p] for p in self.model._unique_parameters()]

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The whole ones as they are, then the split ones in one all-gather per dtype (a stream's bucket)."""
        split: dict[torch.dtype, list[tuple[torch.Tensor, TpSplit]]] = {}
        for p in params:
            own = self.weights.split(p)
            if own is None:
                yield p, p.detach()
            else:
                split.setdefault(p.dtype, []).append((p, own))
        for together in split.values():
            yield from gather_together(together)  # type: ignore[misc]

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.many(params)

    def full(self, modifier_rank: int | None) -> contextlib.AbstractContextManager[Any]:
        # ``gathered()`` builds the transformers model of the Hub layout instead (``whole_in_hub_layout``), and
        # writes go to the slices (``write_values``): the parallel layers never run on full weights.
        raise UnsupportedModelError(
            "a Megatron-Core model's own modules are never gathered: its parallel layers run their collectives "
            "whatever weights they hold. gathered() and generation() give the transformers model of its Hub "
            "layout; write values with load_full_state_dict().")

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[None]:
        yield  # the parallel layers' own forward, as it is

    def bypass(self) -> Bypass | None:
        return None

    def full_bytes(self) -> int:
        return sum(self.weights.global_numel(p) * p.element_size() for p in self.model._unique_parameters())


def _reader(local: torch.Tensor) -> Any:
    """A ``Piece.live`` for a rank's slice (or a chunk of it): its elements as the module holds them, 1-D (the
    training state does not read these parts: only a delta sync's diff, where ``box`` places a column block)."""
    return lambda: local.detach().reshape(-1)
