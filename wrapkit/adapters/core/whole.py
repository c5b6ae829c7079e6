"""The parts of a model whose every rank holds each parameter whole: a plain module, DataParallel,
DDP, and a DeepSpeed engine below ZeRO-3. Gathering is reading; a write on one rank is broadcast; a
frozen copy is a deep copy; sleeping moves the module and the torch optimizer's state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..._agree import settle
from ..._gather import Bypass, broadcast_
from ..._names import canonical_name
from .likeness import replicated_copy
from .parts import Parts, Written, flat_view, local_tensor
from .primitives import Piece, copy_into

if TYPE_CHECKING:
    from .primitives import AdapterView

__all__ = ["WholeWeights", "WholeGatherer", "WholePlacement", "WholeLikeness", "TorchStates", "whole_parts",
           "move_buffers"]


def move_buffers(root: torch.nn.Module, target: torch.device, copy: bool) -> None:
    """Move every buffer under ``root``, for backends that move their parameters themselves."""
    for module in root.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(target, copy=copy)


def whole_parts(model: AdapterView) -> Parts:
    return Parts(WholeWeights(model), WholeGatherer(model), WholePlacement(model), WholeLikeness(model),
                 TorchStates())


class WholeWeights:
    def __init__(self, model: AdapterView) -> None:
        self.model = model

    def global_numel(self, p: torch.Tensor) -> int:
        return p.numel()

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}

    def resident_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model._innermost.parameters():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:  # tied parameters, and views of one storage, count once
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def count(self, trainable_only: bool) -> int:
        model = self.model
        return sum(self.global_numel(p) for p in model._unique_parameters() if p.requires_grad or not trainable_only)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        full = self.full_shapes()
        return {canonical_name(name): full.get(id(p), tuple(p.shape))
                for name, p in self.model.unwrap().named_parameters(remove_duplicate=False)}

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        return None

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return None

    def pieces(self) -> list[Piece]:
        return [Piece(canonical_name(name), 0, p.numel(), tuple(p.shape), copy_into(p.data), source=p,
                      values=flat_view) for name, p in self.model.unwrap().named_parameters()]

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        return None  # the weights are all there is: nothing derived to refresh


class WholeGatherer:
    def __init__(self, model: AdapterView) -> None:
        self.model = model

    def one(self, p: torch.Tensor) -> torch.Tensor:
        return p.detach()

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.unwrap().named_parameters(remove_duplicate=False):
            yield canonical_name(name), self.one(p)

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        return [[p] for _, p in self.model.unwrap().named_parameters()]

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        for p in params:
            yield p, p.detach()

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.many(params)

    def bypass(self) -> Bypass | None:
        return None

    def full_bytes(self) -> int:
        model = self.model
        return sum(model.weights.global_numel(p) * p.element_size() for p in model._unique_parameters())

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[None]:
        yield  # nothing is sharded: the module's own forward runs on whole weights

    @contextlib.contextmanager
    def full(self, modifier_rank: int | None) -> Iterator[Any]:
        model = self.model
        group = model.process_group()
        params = list(model._unique_parameters())
        # Replicas are written in place: keep a copy to undo a failed body.
        saved = [p.detach().clone() for p in params] if modifier_rank is not None else []

        def finish(failed: bool) -> None:
            if modifier_rank is None:
                return
            with torch.no_grad():
                if failed:
                    for p, old in zip(params, saved, strict=True):
                        p.copy_(old)
                else:
                    broadcast_(params, modifier_rank, group, model.world_size)
                    model.weights.written(Written.WEIGHTS)

        # Only a write-back needs every rank's verdict; without one the exit has no
        # collective at all, so no rank waits there for a slower one.
        with settle(finish, modifier_rank is not None, group, model.world_size):
            yield None


class WholePlacement:
    def __init__(self, model: AdapterView) -> None:
        self.model = model

    def move(self, target: torch.device, copy: bool) -> None:
        self.model.module._apply(lambda t: t.to(target, copy=copy))  # type: ignore[no-untyped-call]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        module = self.model.module
        seen: set[int] = set()
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                yield canonical_name(name), t

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from self.model.module.parameters()


class WholeLikeness:
    """A replicated model's copies: a frozen copy needs no wrapper, only the model's device."""

    takes_config = False
    own_ops = False

    def __init__(self, model: AdapterView, start: Callable[[], torch.nn.Module] | None = None) -> None:
        self.model = model
        # A replicated wrapper adds nothing to a frozen model: copies start from the module inside it
        # (PEFT kept); a plain model gives its own (``start``).
        self.start = start or (lambda: model.unwrap(keep_peft=True))

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        return module.to(self.model.device)

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        return replicated_copy(self.model, self.wrap, ds_config)


class TorchStates:
    """A backend that keeps no training state of its own: the torch optimizer passed in holds it."""

    def own_optimizer(self) -> Any:
        return None

    def tensors(self, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for state in getattr(optimizer, "state", {}).values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield "optimizer state", local_tensor(value)

    def offload(self, home: torch.device) -> Callable[[], None] | None:
        return None
