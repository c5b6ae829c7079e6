"""Adapter registry and detection.

Rules:

1. Detection never imports an optional library. Each adapter's ``matches`` looks
   its wrapper class up in ``sys.modules``; a library that was never imported
   cannot have produced the object.
2. Adapters are tried in order, most specific first: registered third-party
   adapters, then DeepSpeed, FSDP1, FSDP2, DDP, DataParallel. Where no wrapper
   matched, a model holding DTensor parameters is tensor parallel, and one carrying
   transformers' pipeline stage is a pipeline (``CONTENT_ADAPTERS``); plain is the fallback.
3. The object is peeled from the outside in. ``torch.compile`` and PEFT layers
   may sit anywhere; the first backend wrapper met decides ``backend``. FSDP2
   does not wrap, so it is recognised on the module itself and not peeled.
4. Detection results are cached per type (``type -> matching layer or None``):
   a class that existed before a library was imported cannot subclass that
   library's wrapper, so a cached miss stays true.
5. An unknown class that looks like a wrapper (its only child is ``.module``) is
   refused, never peeled by guessing: peeling the wrong thing silently gives
   the wrong config and the wrong parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import AdapterRegistrationError, UnsupportedModelError
from ._protocol import Handle
from .adapters import BUILTIN_ADAPTERS, CONTENT_ADAPTERS, Adapter, DeepSpeedAdapter, PlainAdapter
from .adapters.core.base import Entry
from .adapters.flat.inside import fsdp1_mark
from .adapters.pipeline import over_stages
from .adapters.slices.megatron import megatron_module
from .adapters.stages.plan import adopt_torch_stage, recorded_stage
from .adapters.zero.inside import engines_hook_modules, hooked_engines, live_engines, zero_mark
from .layers import LAYERS, Layer

__all__ = ["as_adapter", "copy_target", "register_adapter", "registered_adapters"]

_Peeler = type[Adapter] | type[Layer]

_registered: list[type[Adapter]] = []
_cache: dict[type, _Peeler | None] = {}


def registered_adapters() -> tuple[type[Adapter], ...]:
    """All adapters in detection order (plain, the fallback, last)."""
    return (*_registered, *BUILTIN_ADAPTERS, PlainAdapter)


def register_adapter(cls: type[Adapter], *, override: bool = False) -> type[Adapter]:
    """Register an adapter class for a third-party wrapper; usable as a decorator.

    The class must subclass the package's ``Adapter`` base, set a unique ``name``
    and implement ``matches`` (and ``inner`` unless it sets ``peels = False``).
    A name already taken is refused unless ``override=True``, which replaces the
    earlier registration (a built-in adapter can be shadowed, not removed).

    :param cls: the ``Adapter`` subclass.
    :param override: replace an adapter registered under the same name.
    :returns: ``cls``.
    :raises AdapterRegistrationError: not an ``Adapter`` subclass, no name or ``matches`` of its own, or a
        name already taken without ``override``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise AdapterRegistrationError(
            f"register_adapter() takes a subclass of the adapter base class (Adapter), got {cls!r}; "
            "subclass it and implement `matches` and `inner`."
        )
    name = getattr(cls, "name", None)
    own_matches = any("matches" in vars(k) for k in cls.__mro__[: cls.__mro__.index(Adapter)])
    if not isinstance(name, str) or not name or not own_matches:
        raise AdapterRegistrationError(
            f"{cls.__name__} must set a non-empty `name` and implement the `matches(obj)` classmethod."
        )
    taken = [a for a in registered_adapters() if a.name == name]
    if taken and not override:
        raise AdapterRegistrationError(
            f"an adapter named {name!r} is already registered ({taken[0].__name__}); choose another name or "
            "pass override=True to replace it."
        )
    _registered[:] = [a for a in _registered if a.name != name]
    _registered.insert(0, cls)
    _cache.clear()
    return cls


def _find_peeler(obj: torch.nn.Module) -> _Peeler | None:
    t = type(obj)
    if t in _cache:
        return _cache[t]
    found: _Peeler | None = None
    candidates: list[_Peeler] = [*_registered, *BUILTIN_ADAPTERS, *LAYERS]
    for peeler in candidates:
        if peeler.matches(obj):
            found = peeler
            break
    _cache[t] = found
    return found


def _looks_like_unknown_wrapper(obj: torch.nn.Module) -> bool:
    children = list(obj.named_children())
    return (
        len(children) == 1
        and children[0][0] == "module"
        and not any(True for _ in obj.named_parameters(recurse=False))
        and getattr(obj, "config", None) is None
    )


def _describe_object(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _one_chunk(model: Any) -> Any:
    """The model of a one-element list of Megatron-Core chunks; ``model`` itself for anything else."""
    if not isinstance(model, (list, tuple)) or not model or not all(megatron_module(m) for m in model):
        return model
    if len(model) > 1:
        raise UnsupportedModelError(
            f"adapt() got {len(model)} Megatron-Core model chunks (virtual pipeline stages): several chunks per rank "
            "are not read yet. Build the model with virtual_pipeline_model_parallel_size=None (one chunk per rank) "
            "and pass that chunk, or the one-element list.")
    return model[0]


def copy_target(target: Any) -> Adapter:
    """The adapter ``copy_to`` writes into; anything but a ``WrappedModel`` is refused."""
    if not isinstance(target, Handle):
        raise UnsupportedModelError(
            f"copy_to needs a WrappedModel target, got {type(target).__name__}; pass adapt(target)."
        )
    return target._as_adapter("copy_to into it")


def as_adapter(model: Any, purpose: str = "this") -> Adapter:
    """The backend adapter for ``model``, for operations that need one (a view over another
    model refuses, naming ``purpose``)."""
    if isinstance(model, Adapter):
        return model
    if isinstance(model, Handle):
        return model._as_adapter(purpose)
    # A torch.distributed.pipelining stage is read through its module, recorded with the stage's place.
    model = adopt_torch_stage(model)
    # Megatron-Core hands out its model as a list of chunks (one per virtual pipeline stage).
    model = _one_chunk(model)
    if model is None:
        raise UnsupportedModelError(
            "adapt() got None; pass the model (an nn.Module, or the DDP/FSDP/DeepSpeed object wrapping it). "
            "If this is a reference model that PEFT made unnecessary, use prepare_reference(policy, None)."
        )
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"adapt() needs a torch.nn.Module or a wrapper around one, got {_describe_object(model)}"
            + (" (a state dict? load it into a model first)" if isinstance(model, dict) else "")
            + (" (a tensor, not a model)" if isinstance(model, torch.Tensor) else "")
            + "."
        )

    entries: list[Entry] = []
    backend: type[Adapter] | None = None
    backend_obj: torch.nn.Module | None = None
    cur: torch.nn.Module = model
    # Bounded: each step peels one layer, and no real stack is deeper than a handful.
    for _ in range(64):
        peeler = _find_peeler(cur)
        if peeler is not None and issubclass(peeler, Adapter) and backend is not None:
            if peeler is backend and not peeler.peels:
                peeler = None  # FSDP2 root already recorded; look for inner layers
            elif peeler.peels or peeler is not backend:
                raise UnsupportedModelError(
                    f"{_describe_object(model)} nests a {peeler.name} wrapper inside a {backend.name} wrapper "
                    f"(stack so far: {' > '.join(n for n, _ in entries)}); nested backends are not supported — "
                    "wrap the model with one backend only."
                )
        if peeler is None and backend is not None and not backend.peels:
            # Under FSDP2 the root is the model itself; compile/PEFT layers may still be inside.
            layer = _layer_of(cur)
            if layer is None:
                break
            entries.append((layer.name, cur))
            cur = layer.inner(cur)
            continue
        if peeler is None:
            break
        if issubclass(peeler, Adapter):
            backend, backend_obj = peeler, cur
            entries.append((peeler.name, cur))
            if not peeler.peels:
                continue
        else:
            entries.append((peeler.name, cur))
        cur = peeler.inner(cur)

    if _looks_like_unknown_wrapper(cur):
        raise UnsupportedModelError(
            f"{_describe_object(cur)} looks like a wrapper (its only child is `.module`) but no adapter knows it; "
            "it is not peeled by guessing. Register one with wrapkit.register_adapter(MyAdapter) "
            f"(known: {', '.join(a.name for a in registered_adapters())}), or pass the model inside it."
        )
    if backend is not None and (recorded_stage(model) or recorded_stage(cur)) is not None:
        # A pipeline stage inside another backend: that backend's adapter within the stage (pipeline.py).
        backend = over_stages(backend)
        entries.insert(0, ("pipeline", cur))
    if backend is None:
        # No wrapper: a backend that changes no class (tensor parallelism, pipeline stages) is known by what it holds.
        claimed = next((a for a in CONTENT_ADAPTERS if a.claims(cur)), None)
        if claimed is not None:
            return claimed(model, [*entries, (claimed.name, cur)], cur, cur)
        inside = _inside(model, entries, cur)
        if inside is not None:
            return inside
    return (backend or PlainAdapter)(model, entries, backend_obj, cur)


def _layer_of(module: torch.nn.Module) -> type[Layer] | None:
    """The inner layer (compile, PEFT) ``module`` is, or None."""
    return next((lyr for lyr in LAYERS if lyr.matches(module)), None)


def _layer_chain(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and each layer (compile, PEFT) below it, outermost first."""
    chain = [module]
    for _ in range(64):
        layer = _layer_of(chain[-1])
        if layer is None:
            break
        chain.append(layer.inner(chain[-1]))
    return chain


def _inside(model: torch.nn.Module, entries: list[Entry], cur: torch.nn.Module) -> Adapter | None:
    """The adapter of a module that no wrapper holds here but that is the inside of one (``engine.module``,
    ``fsdp.module``, a trainer's ``self.model``): read through the DeepSpeed engine found to hold it, refused
    where the wrapper cannot be found (FSDP1, the empty placeholders a deep copy of a ZeRO-3 module keeps); None
    for a bare module."""
    where = f"{_describe_object(model)} (stack: {' > '.join([*(n for n, _ in entries), type(cur).__name__])})"
    flat = fsdp1_mark(cur)
    if flat is not None:
        raise UnsupportedModelError(
            f"{where} is the module inside an FSDP1 wrapper, not a whole model: {flat}, so each rank holds only its "
            "shard and a bare read would be silently wrong. Pass the FullyShardedDataParallel root that wraps it "
            "(the value accelerator.prepare() returned, or the FSDP(...) object) to adapt() instead."
        )
    objs = list({id(o): o for o in (model, *(o for _, o in entries), cur)}.values())
    mark = zero_mark(cur)
    # DeepSpeed's own hooks name the engine at no cost; a scan of live objects only where the module says it
    # was handed to one, or where this DeepSpeed hooks nothing (an unmarked ZeRO-0 module is then not told apart).
    engines = hooked_engines(objs) or (live_engines() if mark is not None or not engines_hook_modules() else [])
    holding = [e for e in engines if any(o is m for o in objs for m in _layer_chain(e.module))]
    if len(holding) > 1:
        raise UnsupportedModelError(
            f"{where} is held by {len(holding)} live DeepSpeed engines, so which one steps it is not known; pass "
            "the engine that trains it (deepspeed.initialize's first value, or accelerator.prepare's) to adapt()."
        )
    if not holding:
        sizes = [p.numel() for p in cur.parameters()]
        if mark is None and sizes and not any(sizes):
            raise UnsupportedModelError(
                f"{where} has {len(sizes)} parameters and every one holds 0 elements: placeholders of a partitioned "
                "model, not weights (a deep copy of a ZeRO-3 module keeps them without DeepSpeed's marks). Pass the "
                "wrapper that holds the weights, or build the copy from them (wrapkit.prepare_reference(policy), or "
                "load adapt(wrapper).full_state_dict() into a fresh model)."
            )
        # A bare module; whole weights of its own (a deep copy of a ZeRO 1-2 module); or a model partitioned at load
        # (deepspeed.zero.Init, as transformers does under ZeRO-3) that is yet to be handed to an engine: what
        # prepare_reference and TRL's prepare_deepspeed wrap.
        return None
    engine = holding[0]
    adapter = DeepSpeedAdapter(model, [(DeepSpeedAdapter.name, engine), *entries], engine, cur)
    adapter.given_inside = "DeepSpeedEngine"
    return adapter
