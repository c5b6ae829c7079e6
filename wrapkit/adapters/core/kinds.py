"""The two kinds of backend beside the plain module: those that keep a whole replica per rank
(``ReplicatedAdapter``: DataParallel, DDP) and those that hold a part of each parameter (``ShardedAdapter``:
FSDP1, FSDP2, ZeRO-3, tensor parallelism)."""

from __future__ import annotations

from typing import Any

from ..._errors import AdapterRegistrationError
from .base import Adapter
from .primitives import SHARDED_PRIMITIVES, BackendPrimitives

__all__ = ["ShardedAdapter", "ReplicatedAdapter", "defined_by"]


class ShardedAdapter(Adapter):
    """Base of the backends that hold a part of each parameter per rank (FSDP1, FSDP2, ZeRO-3).

    A subclass defines every one of ``SHARDED_PRIMITIVES`` itself, or the class statement raises
    ``AdapterRegistrationError`` naming those it lacks: inheriting the unsharded default would
    read a shard as the full parameter. An intermediate base passes ``abstract=True``.
    """

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        missing = [name for name in SHARDED_PRIMITIVES if defined_by(cls, name) in (Adapter, ShardedAdapter)]
        if missing:
            raise AdapterRegistrationError(
                f"{cls.__name__} derives from ShardedAdapter but does not define {', '.join(missing)}: a sharded "
                "backend gives the parts of its storage kind (parts(), adapters/core/parts.py) and says whether it "
                "is sharded and over which ranks (topology()), since the whole-tensor defaults would read this "
                "rank's shard as the whole parameter (and copy it as the whole model)."
            )


def defined_by(cls: type, name: str) -> type | None:
    """The class in ``cls``'s method resolution order whose own namespace defines ``name``."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


class ReplicatedAdapter(Adapter):
    """Base of the wrappers that keep a full replica per device or rank (DataParallel, DDP)."""

    def frozen_form(self) -> Adapter:
        # A replicated wrapper only exists to average gradients (DDP refuses a model with
        # none to average): the frozen model is the module inside it, with the layers below.
        assert self._backend_obj is not None
        at = next(i for i, (_, obj) in enumerate(self._entries) if obj is self._backend_obj)
        return Adapter(self.inner(self._backend_obj), list(self._entries[at + 1:]), None, self._innermost)


def _conforms(adapter: Adapter) -> BackendPrimitives:
    """Checked by mypy: every adapter implements the backend primitives."""
    return adapter
