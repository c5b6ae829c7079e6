"""The reference a PEFT policy already contains: the policy with its adapters off.

``prepare_reference(policy, None)`` on a PEFT policy whose only trainable weights are its
adapters returns a view: ``AdaptersOff``, a decorator over the policy's adapter, inside the
public ``AdapterDisabledView``. It owns no parameters. Its primitives are the policy's, renamed
to the base model's names (no ``base_layer``, no LoRA keys; the adapters' own parameters are
gathered with their units and left unnamed) and run with every adapter disabled
(``adapters_off``), so every read operation (gathering, generation, export, ``copy_to`` from it)
is the one ``Wrapped`` runs for any model. What would write the policy's weights or move them
(``load``, ``copy_to`` into the view, ``place`` elsewhere, ``sleep``) is refused with
``ReferenceModelError``: those belong to the policy, or to a reference of its own.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, NoReturn

import torch

from .._agree import Call, enter
from .._errors import PlacementError, ReferenceModelError, WrapkitError
from .._gather import Bypass, restore_modes, set_modes
from ..adapters import Adapter, Written
from ..adapters.core.primitives import Piece
from ..layers.peft import adapters_off, base_key_map, merged_layers
from .placement import resolve_device

__all__ = ["AdaptersOff", "ViewModule", "view_possible", "verify_place", "refuse", "refusal", "ITSELF", "READS"]

_OWN_REFERENCE = "prepare_reference(policy, ref_model) for a reference with weights of its own"
ITSELF = f"the target is the policy this reference is a view of; use {_OWN_REFERENCE}"


class AdaptersOff(Adapter):
    """The policy's adapter seen with its adapters off: the frozen base model's primitives.

    Names come from the base model (``base_key_map``); gathering and per-unit gathering run with
    every adapter disabled; nothing is sharded shard-to-shard (``local_shards`` is None), so a
    ``copy_to`` from it streams renamed full values. The policy's members that only read (``READS``,
    below the class) are forwarded, so no unsharded default of ``Adapter`` is ever taken for the
    policy's; every other member raises ``ReferenceModelError``: refusal is the default."""

    name: ClassVar[str] = "adapters-off"

    def __init__(self, policy: Adapter) -> None:  # nothing of its own to detect or check
        self.policy = policy
        # Parts that read the policy's under the base model's names; those that would write or move its
        # weights refuse. No likeness, no states: a copy or a sleep acts on the policy's.
        self.weights, self.gatherer, self.placement = OffWeights(self), OffGatherer(self), OffPlacement(self)
        self.likeness, self.states, self.resume = None, None, None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.policy!r}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdaptersOff) and other.policy == self.policy

    def __hash__(self) -> int:
        return hash((type(self), self.policy))

    @property
    def stack(self) -> tuple[str, ...]:
        return (self.name, *self.policy.stack)

    # -- names: the base model's -------------------------------------------------------------
    def _rename(self) -> Callable[[str], str | None]:
        # Built per call: cheap (one walk of the modules) and never stale if adapters change.
        check_unmerged(self.policy)
        return base_key_map(self.policy.unwrap(keep_peft=True))

    def named_live(self, parameters: bool = True, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        rename = self._rename()
        for name, t in self.policy.named_live(parameters, buffers):
            if (new := rename(name)) is not None:
                yield new, t

    def merge_root(self) -> torch.nn.Module | None:
        return None  # the adapters are off: there is nothing to merge

    # -- counts and summary ----------------------------------------------------------------
    def num_parameters(self, trainable_only: bool = False) -> int:
        """The base model's global count; nothing is trainable through a view."""
        if trainable_only:
            return 0
        # The policy's count less its adapters' (which are never tied, so counted once each).
        return self.weights.count(trainable_only)

    def resident_parameter_bytes(self) -> int:
        """0: the weights belong to the policy and are counted there."""
        return self.weights.resident_bytes()

    def describe(self) -> str:
        p = self.policy
        peft: Any = p.unwrap(keep_peft=True)
        lines = [
            "view:         the policy with its adapters off; owns no parameters",
            f"backend:      {p.backend}" + (f" (ZeRO stage {p.zero_stage})" if p.zero_stage is not None else ""),
            f"stack:        {' > '.join(self.stack)}",
            f"device:       {p.device}",
            f"group:        rank {p.rank} of {p.world_size}",
            f"sharded:      {'yes' if p.is_sharded else 'no'}",
            f"parameters:   {self.num_parameters():,} (0 trainable), the base model's",
            f"adapters:     {', '.join(map(str, getattr(peft, 'peft_config', {}))) or '-'} (off in every call)",
            "mode:         eval and no autograd in every call; the policy's modes are left as they are",
            f"config:       {type(getattr(p.unwrap(keep_peft=False), 'config', None)).__name__}",
        ]
        return "\n".join(lines)


class OffWeights:
    """The policy's weights under the base model's names (``base_key_map``: no ``base_layer``, no LoRA keys).
    Nothing is sharded shard to shard (``local_shards`` is None): a ``copy_to`` from the view streams renamed
    full values. Loads into it are refused."""

    def __init__(self, view: AdaptersOff) -> None:
        self.view, self.policy = view, view.policy

    def global_numel(self, p: torch.Tensor) -> int:
        return self.policy.weights.global_numel(p)

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return self.policy.weights.full_shapes()

    def count(self, trainable_only: bool) -> int:
        if trainable_only:
            return 0  # nothing is trainable through a view
        # The policy's count less its adapters' (which are never tied, so counted once each).
        rename = self.view._rename()
        adapters = sum(math.prod(shape) for name, shape in self.policy.weights.param_shapes().items()
                       if rename(name) is None)
        return self.policy.weights.count(False) - adapters

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        rename = self.view._rename()
        return {new: s for name, s in self.policy.weights.param_shapes().items() if (new := rename(name)) is not None}

    def resident_bytes(self) -> int:
        return 0  # the weights belong to the policy and are counted there

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        return None  # the policy's shards carry the policy's names

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return None

    def pieces(self) -> list[Piece]:
        raise refusal("loading into it")

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        raise refusal("writing its weights")


class OffGatherer:
    """The policy's gatherer, run with every adapter disabled, its names the base model's; ``full`` refuses
    a write-back."""

    def __init__(self, view: AdaptersOff) -> None:
        self.view, self.policy = view, view.policy

    def one(self, p: torch.Tensor) -> torch.Tensor:
        return self.policy.gatherer.one(p)

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        rename = self.view._rename()
        for name, t in self.policy.gatherer.each():
            if (new := rename(name)) is not None:
                yield new, t

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        return self.policy.gatherer.units()

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.policy.gatherer.many(params)

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        return self.policy.gatherer.exported(params)

    def bypass(self) -> Bypass | None:
        return self.policy.gatherer.bypass()

    def full_bytes(self) -> int:
        return self.policy.gatherer.full_bytes()

    @contextlib.contextmanager
    def full(self, modifier_rank: int | None) -> Iterator[Any]:
        check_unmerged(self.policy)
        if modifier_rank is not None:  # agreed on by the caller: refused on every rank alike
            raise ReferenceModelError(
                f"gathered(modifier_rank={modifier_rank}) on a view would write the policy's base weights; "
                f"gather the policy to change them, or use {_OWN_REFERENCE}."
            )
        with self.policy.gatherer.full(None) as replace, adapters_off(self.policy.unwrap(keep_peft=True)):
            yield replace

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[None]:
        check_unmerged(self.policy)
        with self.policy.gatherer.layerwise(), adapters_off(self.policy.unwrap(keep_peft=True)):
            yield


class OffPlacement:
    """Where the policy's tensors are, read; moving or freezing them through a view is refused."""

    def __init__(self, view: AdaptersOff) -> None:
        self.policy = view.policy

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.policy.placement.tensors()

    def move(self, target: torch.device, copy: bool) -> None:
        raise refusal("moving its weights")

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        raise refusal("freezing its weights")


# The policy's members a view reads through as they are: what the backend, group and device are (its
# weights are read through the view's parts, above). Every other member of ``Adapter`` that the view does
# not define itself is refused: a primitive added later that writes, moves or copies weights cannot reach the policy's
# through a view unless it is named here (``tests/references/test_view.py`` checks that none of these writes).
READS = frozenset({
    "backend", "backend_object", "config", "data_parallel_rank", "data_parallel_size", "device", "distributed",
    "hub_layout", "is_encoder_decoder", "is_sharded", "mesh", "module", "outer_groups", "peels", "process_group",
    "rank", "replica_groups",
    "topology", "unsupported_dtensor", "unwrap", "world_size", "zero_stage",
})


def _refused(name: str, member: Any) -> Any:
    """A member that raises ``ReferenceModelError`` when called (or read, for an attribute): never
    reached through the public view, which refuses first on every rank, and loud if an operation
    ever reaches for it."""
    if isinstance(member, property) or not callable(member):
        def read(self: AdaptersOff) -> NoReturn:
            raise refusal(f"reading {name}")
        return property(read, doc=f"Refused: ``{name}`` is not one of the policy's members a view reads.")

    def method(self: AdaptersOff, *args: Any, **kwargs: Any) -> NoReturn:
        raise refusal(f"{name}()")
    method.__name__ = method.__qualname__ = name
    return method


def _forwarded(name: str, member: Any) -> Any:
    if isinstance(member, property) or not callable(member):
        return property(lambda self: getattr(self.policy, name), doc=f"The policy's ``{name}``.")

    def method(self: AdaptersOff, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.policy, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The policy's ``{name}``."
    return method


for _name in dir(Adapter):
    _member = inspect.getattr_static(Adapter, _name)
    if _name.startswith("_") or _name in vars(AdaptersOff) or isinstance(_member, classmethod):
        continue
    setattr(AdaptersOff, _name, _forwarded(_name, _member) if _name in READS else _refused(_name, _member))


# -- the public view's own calls (``AdapterDisabledView`` in ``_adapt.py``) --------------------
def verify_place(view: AdaptersOff, device: torch.device | str | int | None, op: str) -> None:
    """Verify that the policy's weights are on ``device`` (default: where the policy computes);
    a view cannot move them: ``ReferenceModelError`` where they are elsewhere."""
    policy = view.policy
    problem: str | None = None
    try:
        target = policy.device if device is None else resolve_device(device)
    except WrapkitError as exc:
        problem, target = str(exc), policy.device
    off = [] if problem else [name for name, t in policy.placement.tensors() if t.device != target]
    bad, elsewhere = enter(Call.of(op), policy, flags=[problem is not None, bool(off)], invalid=1)
    if bad:
        raise PlacementError(problem or f"{op}({device!r}) names a device another rank cannot use; see its error")
    if elsewhere:
        raise ReferenceModelError(
            f"this reference is a view of the policy's weights, which are not all on {target} "
            f"({', '.join(off[:4]) or 'on another rank'}); a view cannot move them. Place the policy, or use "
            f"{_OWN_REFERENCE}."
        )


def refuse(view: AdaptersOff, call: Call, purpose: str) -> NoReturn:
    """Refuse ``purpose`` on every rank alike, after the call's entry (so a mismatch is still named)."""
    enter(call, view.policy)
    raise refusal(purpose)


def refusal(purpose: str) -> ReferenceModelError:
    return ReferenceModelError(
        f"this reference is the policy itself with its adapters switched off, so {purpose} would act on the "
        f"policy's weights; act on the policy, or use {_OWN_REFERENCE}."
    )


def check_unmerged(policy: Adapter) -> None:
    """Refuse a policy whose adapters are merged into its weights (the same on every rank)."""
    merged = merged_layers(policy.unwrap(keep_peft=True))
    if merged:
        raise ReferenceModelError(
            f"the policy's adapters are merged into its weights ({', '.join(merged[:3])}"
            f"{' and more' if len(merged) > 3 else ''}), so its base weights are not the base model's; call "
            "unmerge_adapter() on the policy first, or use " + _OWN_REFERENCE + "."
        )


class ViewModule(torch.nn.Module):
    """The callable behind the view's ``module``. The policy is held, not registered, so that
    nothing walking this module's parameters can freeze or move the policy."""

    def __init__(self, policy: Adapter) -> None:
        super().__init__()
        object.__setattr__(self, "_policy", policy)
        self.training = False

    @property
    def config(self) -> Any:
        policy: Adapter = self.__dict__["_policy"]
        return policy.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy: Adapter = self.__dict__["_policy"]
        check_unmerged(policy)
        modes = set_modes(policy.module, False)
        try:
            with adapters_off(policy.unwrap(keep_peft=True)), torch.no_grad():
                return policy.module(*args, **kwargs)
        finally:
            restore_modes(modes)


def view_possible(pol: Adapter) -> bool:
    """A PEFT policy whose trainable parameters are all adapter parameters: with the adapters
    off it computes exactly the frozen base model, however far training has gone."""
    if "peft" not in pol.stack:
        return False
    peft_model: Any = pol.unwrap(keep_peft=True)
    names = [str(n) for n in getattr(peft_model, "peft_config", {})]
    if not names or not hasattr(peft_model, "disable_adapter"):
        return False
    for name, p in peft_model.named_parameters():
        parts = name.split(".")
        if p.requires_grad and not any(n in parts for n in names):
            return False
    return True
