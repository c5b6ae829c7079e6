"""Wrapping a user's module the way a policy is wrapped, for references (``prepare_reference``)
and the trainer drop-ins (``integrations``). What "the way a policy is wrapped" means is each
backend's to say (its likeness, ``Likeness.wrap``); this module only decides what gets wrapped.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ReferenceModelError
from .._registry import as_adapter
from ..adapters import Adapter
from ..adapters.core.parts import lacking

__all__ = ["bare_module", "wrap_like"]


def bare_module(ref: Adapter, backend: str) -> torch.nn.Module | Adapter:
    """What wrapping ``ref`` the ``backend`` way starts from: the module itself, unwrapped from a
    replicated wrapper (which adds nothing to a frozen model); or ``ref`` when it is already
    wrapped that way. Any other wrapper is refused."""
    module = ref.likeness.start() if ref.likeness is not None else None
    if module is not None:
        return module
    if ref.backend == backend:
        return ref
    raise ReferenceModelError(
        f"ref_model is wrapped in {ref.backend} but the policy uses {backend}; pass the unwrapped "
        "model and it is sharded the policy's way."
    )


def wrap_like(pol: Adapter, ref: Adapter, ds_config: dict[str, Any] | None) -> Adapter:
    """The reference ``ref`` wrapped as the policy ``pol`` is (as it is, when it already is)."""
    module = bare_module(ref, pol.backend)
    if isinstance(module, Adapter):
        return module
    if pol.likeness is None:
        raise lacking(pol.backend, "likeness.wrap")
    return as_adapter(pol.likeness.wrap(module, ds_config))
