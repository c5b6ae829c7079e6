"""The parts of a model FSDP1 wraps: its parameters flattened into one ``FlatParameter`` per unit, each
rank holding a slice of it (``flat/flat_param.py`` reads where each original parameter lies)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..._agree import settle
from ..._gather import Bypass, broadcast_, bypassed
from ..._imports import lookup
from ..._names import canonical_name
from ..core.internals import FSDP_MANAGED
from ..core.parts import Parts, Written
from ..core.primitives import Piece
from ..core.whole import TorchStates, WholeGatherer, WholePlacement, WholeWeights, move_buffers
from .flat_param import flat_pieces, full_from_shards, gather_in, local_shard

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["flat_parts", "units", "flat_params"]


def flat_parts(model: Adapter) -> Parts:
    return Parts(FlatWeights(model), FlatGatherer(model), FlatPlacement(model), None, TorchStates())


def units(root: Any) -> Iterator[Any]:
    """Every FSDP instance under ``root`` (the root included), outermost first."""
    fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
    assert root is not None and fsdp_cls is not None
    for m in root.modules():
        if isinstance(m, fsdp_cls):
            yield m


def units_with_params(root: Any) -> list[Any]:
    """The units under ``root`` that have parameters (a flat parameter handle), outermost first."""
    return [u for u in units(root) if getattr(u, "_handle", None) is not None]


def handles(root: Any) -> list[Any]:
    """The flat parameter handle of every unit that has parameters."""
    return [u._handle for u in units_with_params(root)]


def flat_params(root: Any) -> Iterator[Any]:
    """The FlatParameter of every unit that has parameters."""
    for handle in handles(root):
        yield handle.flat_param


class FlatWeights(WholeWeights):
    def resident_bytes(self) -> int:
        # The original parameters are views into FlatParameters: count the flat storage
        # this rank holds (its shard, and the padded full buffer while it is allocated).
        total = 0
        for flat in flat_params(self.model.backend_object):
            local = getattr(flat, "_local_shard", flat)
            total += local.numel() * local.element_size()
            padded = getattr(flat, "_full_param_padded", None)
            if isinstance(padded, torch.Tensor):
                total += padded.untyped_storage().nbytes()
        return total

    def count(self, trainable_only: bool) -> int:
        # The original parameters live inside FlatParameters; their sizes are recorded
        # there (``_numels``, shared parameters already counted once). With
        # use_orig_params=True the original Parameters keep their own requires_grad.
        total = 0
        for flat in flat_params(self.model.backend_object):
            originals = getattr(flat, "_params", None)
            flags = [p.requires_grad for p in originals] if originals is not None else [flat.requires_grad] * len(
                flat._numels)
            total += sum(n for n, rg in zip(flat._numels, flags, strict=True) if rg or not trainable_only)
        return total

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        # With use_orig_params=True each original parameter is a 1-D view of this
        # rank's slice outside of forward; its real shape is recorded in the FlatParameter.
        shapes: dict[int, tuple[int, ...]] = {}
        for flat in flat_params(self.model.backend_object):
            originals = getattr(flat, "_params", None)
            if originals is not None:
                for p, shape in zip(originals, flat._shapes, strict=True):
                    shapes[id(p)] = tuple(shape)
        return shapes

    def global_numel(self, p: torch.Tensor) -> int:
        # An original parameter is a view of this rank's slice; a FlatParameter (use_orig_params=False)
        # holds the whole unit, whose parameters' sizes it records.
        shape = self.full_shapes().get(id(p))
        if shape is not None:
            return math.prod(shape)
        numels = getattr(p, "_numels", None)
        return int(sum(numels)) if numels is not None else p.numel()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        # use_orig_params=False: only FlatParameters are registered (``<module>._flat_param``);
        # the originals' names and shapes are recorded in each of them.
        out = super().param_shapes()
        for name, p in self.model.unwrap().named_parameters(remove_duplicate=False):
            flat: Any = p
            fqns = getattr(flat, "_fqns", None)
            if fqns is None or getattr(flat, "_params", None) is not None:
                continue
            del out[canonical_name(name)]
            prefix = name.rpartition(".")[0]
            shapes = {(info.module_name, info.param_name): tuple(shape)
                      for info, shape in zip(flat._param_infos, flat._shapes, strict=True)}
            for fqn, shape in zip(fqns, flat._shapes, strict=True):
                out[canonical_name(f"{prefix}.{fqn}" if prefix else fqn)] = tuple(shape)
            for info in flat._shared_param_infos:
                fqn = f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name
                out[canonical_name(f"{prefix}.{fqn}" if prefix else fqn)] = shapes[
                    (info.prim_module_name, info.prim_param_name)
                ]
        return out

    # A rank's slice of a FlatParameter runs across parameter boundaries: there is no shard of each
    # parameter to sync shard to shard, so copy_to gathers (each unit once): ``local_shards`` is None.

    def pieces(self) -> list[Piece]:
        return flat_pieces(self.model.unwrap(), handles(self.model.backend_object))


class FlatGatherer(WholeGatherer):
    def bypass(self) -> Bypass:
        # FSDP1 stands in the module tree itself (a wrapper per unit), and its hooks and method
        # wrappers live in torch.distributed.fsdp.
        return Bypass(("torch.distributed.fsdp.",), peel=_unit_inside, flags_off=FSDP_MANAGED)

    def _compute_dtypes(self) -> dict[int, torch.dtype]:
        """id(module) -> the dtype its FSDP unit computes in (``MixedPrecision.param_dtype``),
        for the modules whose unit computes in another dtype than it stores."""
        out: dict[int, torch.dtype] = {}
        root = self.model.backend_object
        if getattr(root, "_use_full_prec_in_eval", False):
            return out  # FSDP_USE_FULL_PREC_IN_EVAL: FSDP1 computes in full precision in eval mode
        for unit in units(root):  # outermost first: an inner unit overrides its parent
            handle = getattr(unit, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            dtype = getattr(handle, "_fwd_bwd_param_dtype", None)
            if flat is None or dtype is None or dtype == flat.dtype:
                continue
            for m in unit._fsdp_wrapped_module.modules():
                out[id(m)] = dtype
        return out

    def _offloaded(self) -> bool:
        return bool(getattr(getattr(self.model.backend_object, "cpu_offload", None), "offload_params", False))

    @contextlib.contextmanager
    def full(self, modifier_rank: int | None) -> Iterator[Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.model
        root = model.backend_object
        assert root is not None
        group = model.process_group()
        flats = list(flat_params(root))
        # writeback copies each rank's own slice of its full copy back into its shard:
        # rank r's values are broadcast first; a failed body restores the saved shards.
        saved = [f.detach().clone() for f in flats] if modifier_rank is not None else []
        outcome = {"failed": False}
        replicas = model.replica_groups()

        def before_writeback(failed: bool) -> None:
            outcome["failed"] = failed
            if modifier_rank is not None and not failed:
                params = list(model._unique_parameters())
                broadcast_(params, modifier_rank, group, model.world_size)
                # HYBRID_SHARD: the first replica's values go to every replica, so the copies stay equal.
                for replica_group in replicas:
                    broadcast_(params, 0, replica_group, model.world_size)

        # summon_full_params gives the stored (full-precision) values; a forward under
        # MixedPrecision computes with them cast to param_dtype, and so does a reader here.
        # A writer (modifier_rank) gets the stored values, so that its writes are kept exactly.
        dtypes = self._compute_dtypes() if modifier_rank is None else {}
        cast: dict[int, torch.nn.Parameter] = {}

        def replace(mod: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor | None:
            dtype = dtypes.get(id(mod))
            if dtype is None or not p.is_floating_point() or p.dtype == dtype:
                return None
            if id(p) not in cast:
                cast[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            return cast[id(p)]

        # Reading: every unit's shard in one all-gather (summon_full_params makes one per unit), in
        # the compute dtype, as FSDP1's forward gathers them (half the bytes in bf16).
        fast = self._gather_in(dtypes) if modifier_rank is None and not self._offloaded() else None
        hooks = [self._cast_root_inputs()] if dtypes else []
        try:
            if fast is not None:
                yield lambda mod, name, p: fast.get(id(p))
                return
            with FullyShardedDataParallel.summon_full_params(
                root, recurse=True, writeback=modifier_rank is not None
            ), settle(before_writeback, modifier_rank is not None, group, model.world_size, replicas):
                yield replace if dtypes else None
        finally:
            for hook in hooks:
                hook.remove()
            if modifier_rank is not None:
                with torch.no_grad():
                    if outcome["failed"]:
                        for f, old in zip(flats, saved, strict=True):
                            f.data.copy_(old)
                    else:
                        model.weights.written(Written.WEIGHTS)

    def full_bytes(self) -> int:
        total = 0
        for handle in handles(self.model.backend_object):
            flat = handle.flat_param
            dtype = getattr(handle, "_fwd_bwd_param_dtype", None) or flat.dtype
            total += flat._unpadded_unsharded_size.numel() * dtype.itemsize
        return total

    @contextlib.contextmanager
    def layerwise(self) -> Iterator[None]:
        # The inner units gather themselves in their forward. The root unit's parameters
        # (embeddings, final norm, head) are used by ``unwrap()``'s own code, outside any
        # unit's forward: they are unsharded here, as the root's forward would, in the dtype
        # it computes in, and resharded on exit. The root's lazy init runs first, so that
        # an inner unit never takes itself for the root.
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        root: Any = self.model.backend_object
        _lazy_init(root, root)
        handle = getattr(root, "_handle", None)
        hooks = [self._cast_root_inputs()] if self._compute_dtypes() else []
        try:
            if handle is not None:
                handle.pre_unshard()
                handle.unshard()
                handle.post_unshard()
            yield
        finally:
            for hook in hooks:
                hook.remove()
            if handle is not None:
                handle.reshard(handle.uses_sharded_strategy)
                handle.post_reshard()
                handle._prefetched = False

    def _gather_in(self, dtypes: dict[int, torch.dtype]) -> dict[int, torch.nn.Parameter] | None:
        """Every original parameter, full, in its unit's compute dtype, from one all-gather of all
        the units' shards; None where that layout does not hold (use_orig_params=False, NO_SHARD,
        units computing in different dtypes): summon_full_params serves those."""
        with_params = units_with_params(self.model.backend_object)
        return gather_in(with_params, dtypes, self.model.process_group(), self.model.world_size)

    def _cast_root_inputs(self) -> Any:
        """FSDP1's root casts floating inputs to ``param_dtype`` (``cast_root_forward_inputs``); the
        same cast, as a hook of ours on the module ``bypassed`` runs, since FSDP's is taken out."""
        from torch.distributed.utils import _cast_forward_inputs

        policy = getattr(self.model.backend_object, "mixed_precision", None)
        dtype = getattr(policy, "param_dtype", None) if getattr(policy, "cast_root_forward_inputs", False) else None

        def cast(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            return _cast_forward_inputs(dtype, *args, **kwargs)
        return self.model.unwrap().register_forward_pre_hook(cast, with_kwargs=True)

    def _sharded_units(self) -> list[Any] | None:
        """The units with parameters, where one all-gather of their shards serves any set of them
        (``gather_in``: use_orig_params=True, sharded, shards on the compute device); else None."""
        with_params = units_with_params(self.model.backend_object)
        if (self._offloaded() or self.model.world_size < 2
                or any(u._handle.flat_param._params is None or not u._handle.uses_sharded_strategy
                       for u in with_params)):
            return None
        shards = [local_shard(u._handle.flat_param) for u in with_params]
        return with_params if len({(s.dtype, s.device) for s in shards}) <= 1 else None

    def units(self) -> list[list[torch.nn.Parameter]] | None:
        # A unit's FlatParameter is the smallest thing FSDP1 gathers: its original parameters go together.
        found = self._sharded_units()
        return None if found is None else [list(u._handle.flat_param._params) for u in found]

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        found = self._sharded_units()
        assert found is not None, "many() needs units()"
        wanted = {id(p) for p in params}
        found = [u for u in found if any(id(p) in wanted for p in u._handle.flat_param._params)]
        full = gather_in(found, {}, self.model.process_group(), self.model.world_size)
        assert full is not None
        for p in params:
            yield p, full[id(p)].detach()

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One FSDP unit at a time: a unit's FlatParameter is the smallest thing FSDP1 gathers.
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.model
        names: dict[int, list[str]] = {}
        for name, p in model.unwrap().named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(canonical_name(name))
        with_params = units_with_params(model.backend_object)
        if any(getattr(u._handle.flat_param, "_params", None) is None for u in with_params):
            # use_orig_params=False: the originals are not Parameters; gather the whole model.
            with self.full(None) as replace, bypassed(model.unwrap(), self.bypass(), replace) as inner:
                batch = [(canonical_name(n), p.detach().clone())
                         for n, p in inner.named_parameters(remove_duplicate=False)]
            yield from batch
            return
        for unit in with_params:
            flat = unit._handle.flat_param
            if model.world_size > 1 and unit._handle.uses_sharded_strategy and hasattr(flat, "_local_shard"):
                yield from full_from_shards(flat, names, model.process_group(), model.world_size, model.rank)
                continue
            with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
                # Copied out before the unit is resharded, so nothing collective is pending at a yield.
                batch = [(n, p.detach().clone()) for p in flat._params for n in names.get(id(p), [])]
            yield from batch


def _repoint_saved_views(handle: Any) -> None:
    """Under NO_SHARD, the views of each original parameter that a training forward saved for its
    backward (``_tensors``) point into the flat parameter's own storage, and FSDP clears them only for
    sharded strategies: left alone they keep the old storage alive on the device after a move (a
    sleep freed the model's optimizer state and gradients but not its weights). Pointed at the new one."""
    saved = getattr(handle.flat_param, "_tensors", None)
    if not saved:
        return
    for tensor, view in zip(saved, handle._get_unflat_views(), strict=True):
        if tensor is not None:
            tensor.data = view


class FlatPlacement(WholePlacement):
    def move(self, target: torch.device, copy: bool) -> None:
        # Each unit's FlatParameter holds this rank's shard (``_local_shard`` aliases it at
        # rest); the original parameters are views into it and must be re-pointed.
        for unit in units(self.model.backend_object):
            handle = getattr(unit, "_handle", None)
            if handle is None:
                continue
            if getattr(handle._training_state, "name", "IDLE") != "IDLE":
                raise RuntimeError(f"FSDP unit {type(unit._fsdp_wrapped_module).__name__} is mid forward/backward")
            flat = handle.flat_param
            # With use_orig_params FSDP may keep a stale flat gradient after zero_grad(); it
            # must not be handed back to parameters whose gradients were cleared.
            had_grads = any(p.grad is not None for p in getattr(flat, "_params", None) or ())
            new = flat.data.to(target, copy=copy)
            if getattr(flat, "_local_shard", None) is not None:
                flat._local_shard = new  # FSDP points flat_param back at it after every reshard
            flat.data = new
            if flat.grad is not None:
                flat.grad.data = flat.grad.data.to(target, copy=copy)
            if handle._use_orig_params:
                handle._use_sharded_views()
                if flat.grad is not None and had_grads:
                    handle._use_sharded_grad_views()
                if not handle.uses_sharded_strategy:
                    _repoint_saved_views(handle)
        move_buffers(self.model.module, target, copy)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
        root = self.model.backend_object
        assert root is not None and fsdp_cls is not None
        for path, unit in root.named_modules():
            handle = getattr(unit, "_handle", None) if isinstance(unit, fsdp_cls) else None
            if handle is not None:
                yield f"{canonical_name(path) or '<root>'} (flat parameter shard)", handle.flat_param
        for name, buf in self.model.module.named_buffers():
            yield canonical_name(name), buf

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        # The FlatParameter too: with use_orig_params=True forward runs through it.
        yield from super().frozen_parameters()
        yield from flat_params(self.model.backend_object)


def _unit_inside(child: torch.nn.Module) -> torch.nn.Module:
    """The module an FSDP unit wraps (through nested units); any other module itself."""
    fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
    while fsdp_cls is not None and isinstance(child, fsdp_cls):
        inner = child._fsdp_wrapped_module
        assert isinstance(inner, torch.nn.Module)
        child = inner
    return child
