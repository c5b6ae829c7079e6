"""The private attributes of FSDP1, FSDP2/DTensor and ZeRO-3 that wrapkit reads, checked in one
place when a model is adapted.

These backends have no public API for what wrapkit needs (per-parameter shard ranges, the
partition of a ZeRO-3 parameter, FSDP2's input and output casts). Their private fields are
stable across the versions wrapkit is tested with; a version that renamed one would otherwise
fail deep inside an operation with an ``AttributeError``. Checking on ``adapt()`` turns that
into an ``UnsupportedModelError`` that names the version and what to install.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._errors import UnsupportedModelError
from .._imports import version_of

__all__ = ["require_internals", "FSDP1_UNIT", "FSDP1_HANDLE", "FSDP1_FLAT", "FSDP2_STATE", "DTENSOR", "ZERO3_PARAM"]

# What each backend's objects must have, by the object that carries it.
FSDP1_UNIT = ("_handle", "_fsdp_wrapped_module")
FSDP1_HANDLE = ("flat_param", "uses_sharded_strategy")
FSDP1_FLAT = ("_fqns", "_params", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask",
              "_param_infos", "_shared_param_infos", "_shard_param_infos")
FSDP2_STATE = ("_mp_policy", "_cast_forward_inputs")
DTENSOR = ("_local_tensor",)
ZERO3_PARAM = ("ds_tensor", "ds_shape", "ds_numel", "ds_status")

# The oldest releases the test-suite runs against (.ci/oldest.txt), for the error message.
_TESTED = {"torch": "2.13", "deepspeed": "0.16"}


def require_internals(objects: Iterable[Any], names: Sequence[str], what: str, package: str) -> None:
    """``UnsupportedModelError`` unless every one of ``objects`` has every attribute in ``names``."""
    for obj in objects:
        missing = [n for n in names if not hasattr(obj, n)]
        if missing:
            version = version_of(package) or "(unknown version)"
            raise UnsupportedModelError(
                f"this {package} {version} has no {', '.join(missing)} on its {what} ({type(obj).__name__}), "
                f"which wrapkit reads for lack of a public API; install a {package} release wrapkit supports "
                f"(tested from {_TESTED.get(package, 'the oldest declared release')} to the newest), or upgrade "
                "wrapkit."
            )
