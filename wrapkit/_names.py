"""Canonical parameter names: the names the innermost model itself would use."""

from __future__ import annotations

import functools

from ._errors import ArgumentError

__all__ = ["canonical_name", "model_class_name", "WRAPPER_PREFIXES"]

# Path components that wrappers insert anywhere in a name.
_INFIX_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# ``module`` is inserted by DataParallel, DDP and DeepSpeed at the front only; a
# model's own submodule may legitimately be called ``module`` further down.
WRAPPER_PREFIXES = ("module",)


@functools.lru_cache(maxsize=65536)
def canonical_name(name: str) -> str:
    """Strip the components that wrappers add to a parameter name.

    ``module.`` is removed where it leads the name (possibly repeated, possibly
    mixed with the other wrapper components); ``_orig_mod.``,
    ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` are removed
    wherever they appear.

    >>> canonical_name("module._orig_mod.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight")
    'model.layers.0.mlp.up_proj.weight'

    :param name: a parameter's name as ``named_parameters()`` of a wrapped model gives it.
    :raises ArgumentError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise ArgumentError(f"canonical_name() takes a parameter name (str), got {name!r} ({type(name).__name__})")
    parts = name.split(".")
    out: list[str] = []
    leading = True
    for part in parts:
        if part in _INFIX_COMPONENTS:
            continue
        if leading and part in WRAPPER_PREFIXES:
            continue
        leading = False
        out.append(part)
    return ".".join(out)


def model_class_name(obj: object) -> str:
    """The model's own class name, seeing through the classes FSDP2 generates (``FSDPLlama...``)."""
    for cls in type(obj).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp"):
            return cls.__name__
    return type(obj).__name__
