"""What this rank holds of a training state: each parameter's weights and optimizer state as boxes of the full
tensors, read from the backend's parts (``save_state`` / ``load_state``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .._errors import ArgumentError, StateDictError
from ..adapters.core.parts import Held, Piece, Written
from ..adapters.stages.plan import every_stage
from ..formats.dcp import Blocks, boxes
from .optimizers import unwrap_optimizer

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["Holding", "hyper", "put_scalar", "scalars", "specs", "state_tensors", "unplaced"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


class Holding:
    """What this rank holds of the training state: from the backend's ``Resume`` part where its optimizer keeps
    the state apart (a DeepSpeed engine's), else from its weights' pieces and the torch optimizer's ``state``."""

    def __init__(self, wm: Adapter, optimizer: Any, where: str, problems: list[str]) -> None:
        self.wm, self.resume = wm, wm.resume
        self.pieces: list[Piece] = []
        if self.resume is not None:
            own = self.resume.optimizer()
            # The engine's optimizer wraps the torch one that steps: either may be passed, or a wrapper of it.
            if optimizer is not None and unwrap_optimizer(optimizer, own) is not own:
                raise ArgumentError(f"{where}(optimizer=...): the {wm.backend} model steps its own optimizer; pass "
                                    "None (or that optimizer)")
            self.optimizer: Any = own
            # The parameters its optimizer does not step (frozen ones) are read from the weights themselves.
            self.pieces = [p for p in wm.weights.pieces() if p.source is not None and p.values is not None]
        else:
            # A backend that steps its own optimizer (a ZeRO-0 engine's torch optimizer) uses it by default.
            own = wm.states.own_optimizer() if wm.states is not None else None
            self.optimizer = unwrap_optimizer(optimizer, own) if optimizer is not None else own
            self.pieces = _readable(wm, problems)
            if self.optimizer is not None and self.pieces and not self._covers_any():
                problems.append(f"the optimizer ({type(optimizer).__name__}) steps none of this model's parameters "
                                "and holds no state for them: pass the optimizer built over this model's "
                                "parameters (a container's inner optimizers are read where wrapkit knows it: "
                                "torchtitan's, accelerate's, DeepSpeed's)")

    def _covers_any(self) -> bool:
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]} | {id(p) for p in self.optimizer.state}
        return any(id(piece.source) in held for piece in self.pieces)

    def group_names(self) -> list[list[str]]:
        """The names of the parameters in each of the optimizer's groups (on a pipeline stage, this stage's)."""
        if self.resume is not None:
            return [sorted(g) for g in self.resume.group_names()]
        return _groups(self.optimizer, _param_names(self.wm, self.pieces))

    def whole_group_names(self) -> list[list[str]]:
        """``group_names`` of the whole model: on pipeline stages, whose optimizers each step their own layers,
        group ``i`` of every stage's optimizer joined (a collective over the stages, entered by every rank)."""
        mine = self.group_names()
        every = every_stage(self.wm, mine)
        if every is None:
            return mine
        joined: list[list[str]] = [[] for _ in range(max(len(groups) for groups in every))]
        for groups in every:
            for i, names in enumerate(groups):
                joined[i].extend(n for n in names if n not in joined[i])
        return [sorted(names) for names in joined]

    def held(self) -> list[Held]:
        out: list[Held] = []
        if self.resume is not None:
            out = self.resume.held()
            stepped = {n for g in self.resume.group_names() for n in g}
            for piece in self.pieces:  # weights alone, of the parameters the optimizer does not step
                if piece.name not in stepped:
                    assert piece.values is not None and piece.source is not None
                    out.append(Held(piece.name, tuple(piece.full_shape), piece.start, piece.numel,
                                    piece.values(piece.source), {}, {}, piece.source, piece.box))
            return out
        for piece in self.pieces:
            src, values = piece.source, piece.values
            assert src is not None and values is not None
            st = self.optimizer.state.get(src, {}) if self.optimizer is not None else {}
            per = {k: values(v) for k, v in st.items() if torch.is_tensor(v) and tuple(v.shape) == tuple(src.shape)}
            out.append(Held(piece.name, tuple(piece.full_shape), piece.start, piece.numel, values(src), per,
                            {k: v for k, v in st.items() if k not in per}, src, piece.box))
        return out

    def create(self, saved: dict[str, dict[str, list[Any]]]) -> None:
        """An optimizer that has not stepped gets the state tensors the checkpoint holds (zeros), to load into."""
        if self.optimizer is None:
            return
        keys = {name: {k: (spec[0] == "element", _dtype(spec[1]), tuple(spec[2]) if spec[0] == "tensor" else ())
                       for k, spec in per.items() if spec[0] != "object"}
                for name, per in saved.items()}
        if self.resume is not None:
            self.resume.create(keys)
            return
        trained = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for piece in self.pieces:
            assert piece.source is not None
            if id(piece.source) in trained:
                for key, (per_element, dtype, shape) in keys.get(piece.name, {}).items():
                    _state_tensor(self.optimizer, piece.source, key, dtype, shape, per_element)

    def loaded(self) -> None:
        if self.resume is not None:
            self.resume.loaded()
        else:
            self.wm.weights.written(Written.PIECES)


def _readable(wm: Adapter, problems: list[str]) -> list[Piece]:
    pieces = wm.weights.pieces()
    unreadable = sorted({p.name for p in pieces if p.source is None or p.values is None})
    if unreadable:
        problems.append(f"the {wm.backend} backend's part of {len(unreadable)} parameter(s) ({unreadable[0]}, ...) "
                        "cannot be read as blocks of the full tensor; save_state and load_state do not serve this "
                        "layout yet")
    return [p for p in pieces if p.source is not None and p.values is not None]


def _boxes(h: Held, tensor: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """``tensor`` (``h``'s weights or one of its state tensors) as boxes of the full shape, each a view."""
    if h.box is not None:
        return [(h.box, tensor)]
    if tensor.numel() != h.numel:  # never a silent misread: the view must be exactly the held elements
        raise StateDictError(f"{h.name}: this rank's part has {tensor.numel()} elements where its range holds "
                             f"{h.numel}; the backend's storage is not in the layout save_state reads")
    out, at = [], 0
    for offsets, sizes in boxes(h.full_shape, h.start, h.start + h.numel):
        n = math.prod(sizes)
        out.append(((offsets, sizes), tensor[at:at + n].view(sizes)))
        at += n
    return out


def state_tensors(held: list[Held]) -> dict[str, Blocks]:
    """Every per-element tensor of ``held`` (weights and moments) as ``Blocks`` under its checkpoint key."""
    parts: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for h in held:
        for key, t in (("model/" + h.name, h.weights), *((f"optim/{h.name}/{k}", v) for k, v in h.state.items())):
            parts.setdefault(key, []).extend(_boxes(h, t))
            shapes[key] = h.full_shape
    return {key: Blocks(shapes[key], p, p[0][1].dtype) for key, p in parts.items()}


def scalars(held: list[Held]) -> dict[str, dict[str, Any]]:
    """Name -> the rest of its state (Adam's ``step``): small, so each rank's go in one object."""
    out: dict[str, dict[str, Any]] = {}
    for h in held:
        if h.scalars and h.name not in out:
            out[h.name] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in h.scalars.items()}
    return out


def unplaced(held: list[Held], saved: dict[str, dict[str, list[Any]]]) -> list[str]:
    """Never a silent restart from zero: each held parameter's per-element state that the checkpoint has (its
    ``saved`` keys by name, as ``specs`` gives them) and this optimizer has no place for."""
    out = []
    for h in held:
        lost = sorted(k for k, spec in saved.get(h.name, {}).items() if spec[0] == "element" and k not in h.state)
        if lost:
            out.append(f"{h.name}'s optimizer state {lost} has no place in this optimizer")
    return out


def put_scalar(optimizer: Any, h: Held, key: str, value: Any) -> None:
    """A loaded scalar state (Adam's ``step``) into ``h``'s optimizer state: in place where it holds a tensor."""
    have = h.scalars.get(key, optimizer.state[h.owner].get(key))
    if torch.is_tensor(have) and torch.is_tensor(value):
        have.copy_(value)
    else:
        optimizer.state[h.owner][key] = value


def specs(held: list[Held]) -> dict[str, dict[str, list[Any]]]:
    """Name -> each state key's kind, for the manifest: ``["element", dtype]`` (per element, saved in boxes),
    ``["tensor", dtype, shape]`` or ``["object"]``."""
    out: dict[str, dict[str, list[Any]]] = {}
    for h in held:
        spec = out.setdefault(h.name, {})
        for k, v in h.state.items():
            spec[k] = ["element", str(v.dtype)]
        for k, v in h.scalars.items():
            spec[k] = ["tensor", str(v.dtype), list(v.shape)] if torch.is_tensor(v) else ["object"]
    return {n: spec for n, spec in out.items() if spec}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(dtype, torch.dtype):
        raise StateDictError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


def _param_names(wm: Adapter, pieces: list[Piece]) -> dict[int, list[str]]:
    """id(tensor an optimizer holds) -> the canonical names of the parameters it is, for every parameter of the
    model, held here or not."""
    out = wm.parameter_names()
    for piece in pieces:  # an optimizer over tensors the module does not register as its parameters
        out.setdefault(id(piece.source), [piece.name])
    return out


def _groups(optimizer: Any, names: dict[int, list[str]]) -> list[list[str]]:
    return [sorted(n for p in g["params"] for n in names.get(id(p), [f"<unnamed {tuple(p.shape)}>"]))
            for g in optimizer.param_groups]


def hyper(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _state_tensor(optimizer: Any, p: torch.Tensor, key: str, dtype: torch.dtype, shape: tuple[int, ...],
                  per_element: bool) -> None:
    """The optimizer's state tensor ``key`` of ``p``, made (zeros, as the optimizer would) where it has none."""
    st = optimizer.state[p]
    if key in st:
        return
    if per_element:
        st[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    # torch's optimizers keep a scalar step on the CPU unless they step on the device.
    device = p.device if (group.get("capturable") or group.get("fused")) else torch.device("cpu")
    st[key] = torch.zeros(shape, dtype=dtype, device=device)
