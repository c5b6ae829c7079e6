"""The adapter base class: what every backend shares (identity, peeling, the read-only protocol) and the
parts of whole tensors. A backend overrides what its wrapper does differently: detection, device, topology,
parts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..._errors import MissingConfigError
from ..._names import canonical_name, model_class_name
from ...base.module_internals import live_entries
from .checks import check_group, check_layout, check_moved
from .describe import describe
from .parts import Gatherer, Likeness, Parts, Placement, Resume, States, Weights, local_tensor
from .recipes import Recipe
from .topology import Topology
from .whole import move_buffers, whole_parts

__all__ = ["Adapter", "Entry", "model_class_name", "move_buffers", "local_tensor"]

# One peeled layer: (layer or backend name, the object at that level).
Entry = tuple[str, torch.nn.Module]


class Adapter:
    """Base of every backend adapter: the backend's primitives (``adapters/core/primitives.py``) and
    the read-only members of ``WrappedModel``, which the public ``Wrapped`` delegates to.

    Subclasses set ``name`` and implement ``matches`` (and ``inner`` when the
    backend is an outer wrapper object). ``peels`` says whether detection moves
    inside the object (DDP, FSDP1, DeepSpeed) or the object is the model itself
    (FSDP2 changes the class of the module it shards).
    """

    name: ClassVar[str] = "plain"
    peels: ClassVar[bool] = True
    # Whether this adapter needs an initialised process group.
    distributed: ClassVar[bool] = False
    # How the doctor and the tests build one (``core/recipes.py``); None: detected and served, never built.
    recipe: ClassVar[Recipe | None] = None

    # The wrapper whose inside was given to adapt() (found from the module, read through it), else None.
    given_inside: str | None = None

    # Set from ``parts()`` (``adapters/core/parts.py``); likeness and states are None where the backend has none.
    weights: Weights
    gatherer: Gatherer
    placement: Placement
    likeness: Likeness | None
    states: States | None
    resume: Resume | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_moved(cls)

    # -- detection -----------------------------------------------------------------
    @classmethod
    def matches(cls, obj: object) -> bool:
        """Whether ``obj`` is this backend's wrapper. Must not import optional libraries."""
        return False

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        """The module this backend's wrapper holds."""
        inner = getattr(obj, "module", None)
        assert isinstance(inner, torch.nn.Module)
        return inner

    # -- construction --------------------------------------------------------------
    def __init__(self, module: torch.nn.Module, entries: list[Entry], backend_obj: torch.nn.Module | None,
                 innermost: torch.nn.Module) -> None:
        self._module = module
        self._entries = tuple(entries)
        self._backend_obj = backend_obj
        self._innermost = innermost
        self.weights, self.gatherer, self.placement, self.likeness, self.states, self.resume = self.parts()
        check_group(self)
        self._check_internals()
        check_layout(self)
        self._check_stack()
        cfg = getattr(innermost, "config", None)
        # Read once: generation code branches on it every step.
        self._is_encoder_decoder = bool(getattr(innermost if cfg is None else cfg, "is_encoder_decoder", False))

    # -- identity ------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend!r} stack={' > '.join(self.stack)}>"

    def __eq__(self, other: object) -> bool:
        # Same backend over the same object: the plain adapter a frozen DDP model gives equals adapt() of it.
        return isinstance(other, Adapter) and other.name == self.name and other._module is self._module

    def __hash__(self) -> int:
        return hash((self.name, id(self._module)))

    # -- read-only protocol ----------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.name

    @property
    def backend_object(self) -> torch.nn.Module | None:
        """The native wrapper object (DDP, FSDP root, DeepSpeed engine, FSDP2 root module), or None."""
        return self._backend_obj

    def mesh(self) -> Any:
        """The device mesh the model is sharded over, where its backend was given one, else None."""
        return self.topology().mesh

    @property
    def stack(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._entries) + (model_class_name(self._innermost),)

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def config(self) -> Any:
        cfg = getattr(self._innermost, "config", None)
        if cfg is None:
            raise MissingConfigError(
                f"{model_class_name(self._innermost)} (innermost of {' > '.join(self.stack)}) has no `config` "
                "attribute; only models that carry one (e.g. transformers models) have a config to return."
            )
        return cfg

    @property
    def is_encoder_decoder(self) -> bool:
        return self._is_encoder_decoder

    def unwrap(self, keep_peft: bool = True, keep_compile: bool = False) -> torch.nn.Module:
        """The innermost model, optionally stopping at a PEFT or compile layer.

        A compile layer *outside* a backend wrapper (``compile(DDP(model))``) is always
        peeled: keeping it would mean keeping the wrapper too.
        """
        below_backend = self._backend_obj is None or not self.peels
        for name, obj in self._entries:
            if name == self.name and self._backend_obj is obj:
                below_backend = True
                continue
            if not below_backend:
                continue
            if (name == "peft" and keep_peft) or (name == "compile" and keep_compile):
                return obj
        return self._innermost

    @property
    def device(self) -> torch.device:
        for t in itertools.chain(self._innermost.parameters(), self._innermost.buffers()):
            return t.device
        return torch.device("cpu")

    @property
    def zero_stage(self) -> int | None:
        return None

    @property
    def is_sharded(self) -> bool:
        return False

    @property
    def world_size(self) -> int:
        return self.topology().size_and_rank()[0] if self.distributed else 1

    @property
    def rank(self) -> int:
        return self.topology().size_and_rank()[1] if self.distributed else 0

    @property
    def data_parallel_size(self) -> int:
        """How many different batches the ranks holding this model take at each step."""
        return self.topology().data_parallel()[0] if self.distributed else 1

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this rank takes (tensor-parallel ranks share one)."""
        return self.topology().data_parallel()[1] if self.distributed else 0

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Global parameter count, shared (tied) parameters counted once."""
        return self.weights.count(trainable_only)

    def describe(self) -> str:
        """A human-readable multi-line summary."""
        return describe(self)

    def resident_parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds right now (its shards, plus anything
        currently gathered); no collective. Tied parameters count once."""
        return self.weights.resident_bytes()

    # -- parts (adapters/core/parts.py) ------------------------------------------------------
    def parts(self) -> Parts:
        """This model's weights, gatherer, placement, likeness and states: here, those of whole tensors."""
        return whole_parts(self)

    # -- primitives (adapters/core/primitives.py) ---------------------------------------
    def named_live(self, parameters: bool = True, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, this rank's live tensor) for every key of ``unwrap().state_dict()``, in its order."""
        return live_entries(self.unwrap(), parameters=parameters, buffers=buffers)

    def parameter_names(self) -> dict[int, list[str]]:
        """id(each tensor an optimizer over ``module.parameters()`` holds) -> the canonical names of the parameters
        it is: one each here; several for a tensor that flattens many (FSDP1's flat parameters)."""
        out: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters():
            out.setdefault(id(p), [canonical_name(name)])
        return out

    def merge_root(self) -> torch.nn.Module | None:
        """The PEFT model whose LoRA layers ``merge_adapters`` folds in, or None without one."""
        peft = self.unwrap(keep_peft=True)
        return None if peft is self.unwrap(keep_peft=False) else peft

    # -- helpers for subclasses ----------------------------------------------------
    def topology(self) -> Topology:
        """The groups the model lies over: DDP keeps its group as ``process_group``, and nothing repeats."""
        return Topology(getattr(self._backend_obj, "process_group", None), (), None)

    # The parts of ``topology()`` that most code needs alone. A backend describes itself once, in
    # ``topology``, and never defines these (``tests/contract/test_registry.py``).
    def process_group(self) -> Any:
        """The group the model is replicated or sharded over (``None``: the default group)."""
        return self.topology().group

    def replica_groups(self) -> list[Any]:
        """The groups across the copies of a model sharded within each copy (HSDP), else empty."""
        return list(self.topology().replicas)

    def outer_groups(self) -> list[Any]:
        """The groups around the model's group that, with it, span every rank holding part of the model
        (HSDP's replicas, pipeline stages beside another backend); an operation is agreed over all of them."""
        return list(self.topology().outer_groups())

    def hub_layout(self) -> Any:
        """The conversion between this model's names and tensors and the Hub's where its backend defines one
        (Megatron-Core's fused layers), else None: transformers' own applies (``formats.hub``)."""
        return None

    def _check_internals(self) -> None:
        """Refuse a backend version whose private fields this adapter reads are missing (``_internals``)."""

    def _check_stack(self) -> None:
        """Refuse a stack of layers this adapter cannot serve (none here; tensor parallelism refuses PEFT)."""

    def unsupported_dtensor(self, p: Any) -> str | None:
        """Why this adapter cannot handle DTensor parameter ``p`` (None: it can). Only the backends that
        shard with DTensors (fsdp2, tp) read them, so here every one is refused."""
        return f"the {self.name} adapter does not shard with DTensors, so this is a layout it cannot read"

    def _unique_parameters(self) -> Iterator[torch.nn.Parameter]:
        seen: set[int] = set()
        for p in self._innermost.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    # -- placement primitives (used by references/placement.py) ------------------------------------
    def frozen_form(self) -> Adapter:
        """The adapter a frozen copy of this model keeps: itself, or for a wrapper that only exists
        for training (DDP, DataParallel) the module inside it."""
        return self

