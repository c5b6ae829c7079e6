"""FSDP1 (``FullyShardedDataParallel``): parameters flattened into one ``FlatParameter``
per wrapped unit, each rank holding a slice of it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from .._agree import settle
from .._gather import Bypass, broadcast_, bypassed
from .._imports import is_instance, lookup
from .._names import canonical_name
from ._base import ShardedAdapter, move_buffers
from ._fsdp_flat import flat_pieces, full_from_shards, gather_in, local_shard
from ._internals import FSDP1_FLAT, FSDP1_HANDLE, FSDP1_UNIT, FSDP_MANAGED, require_internals
from ._likeness import block_classes, copy_buffers, skeleton
from ._primitives import Piece, Topology


class FSDPAdapter(ShardedAdapter):
    name = "fsdp"
    distributed = True

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.distributed.fsdp", "FullyShardedDataParallel")

    def _units(self) -> Iterator[Any]:
        """Every FSDP instance in the tree (the root included), outermost first."""
        fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
        assert self._backend_obj is not None and fsdp_cls is not None
        for m in self._backend_obj.modules():
            if isinstance(m, fsdp_cls):
                yield m

    def _flat_params(self) -> Iterator[Any]:
        """The FlatParameter of every unit that has parameters.

        Its private fields read in this file (``_shapes``, ``_numels``, ``_fqns``,
        ``_param_infos``, ``_shard_param_infos``, ``_params``, ``_local_shard``) are
        documented on ``FlatParameter`` in torch/distributed/fsdp/_flat_param.py; FSDP1
        has no public API for per-parameter shapes or shard ranges."""
        for unit in self._units():
            handle = getattr(unit, "_handle", None)
            if handle is not None:
                yield handle.flat_param

    def _check_internals(self) -> None:
        units = list(self._units())
        require_internals(units, FSDP1_UNIT, "FSDP units", "torch")
        handles = [u._handle for u in units if u._handle is not None]
        require_internals(handles, FSDP1_HANDLE, "flat parameter handles", "torch")
        require_internals([h.flat_param for h in handles], FSDP1_FLAT, "flat parameters", "torch")

    def topology(self) -> Topology:
        # HYBRID_SHARD and _HYBRID_SHARD_ZERO2 shard within ``process_group`` and replicate
        # across ``_inter_node_pg`` (FSDP1 keeps it on the root; other strategies never set it).
        root = self._backend_obj
        strategy = getattr(getattr(root, "sharding_strategy", None), "name", "")
        across = getattr(root, "_inter_node_pg", None)
        replicas = (across,) if "HYBRID" in strategy and across is not None else ()
        mesh = getattr(root, "_device_mesh", None)
        # The mesh HYBRID_SHARD was given is (replicate, shard); a 1-D one shards.
        roles = () if mesh is None else ("replicate", "shard")[-mesh.ndim:]
        return Topology(getattr(root, "process_group", None), replicas, mesh, roles)

    def _compute_dtypes(self) -> dict[int, torch.dtype]:
        """id(module) -> the dtype its FSDP unit computes in (``MixedPrecision.param_dtype``),
        for the modules whose unit computes in another dtype than it stores."""
        out: dict[int, torch.dtype] = {}
        if getattr(self._backend_obj, "_use_full_prec_in_eval", False):
            return out  # FSDP_USE_FULL_PREC_IN_EVAL: FSDP1 computes in full precision in eval mode
        for unit in self._units():  # outermost first: an inner unit overrides its parent
            handle = getattr(unit, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            dtype = getattr(handle, "_fwd_bwd_param_dtype", None)
            if flat is None or dtype is None or dtype == flat.dtype:
                continue
            for m in unit._fsdp_wrapped_module.modules():
                out[id(m)] = dtype
        return out

    @property
    def device(self) -> torch.device:
        dev = getattr(self._backend_obj, "compute_device", None)
        return dev if isinstance(dev, torch.device) else super().device

    @property
    def is_sharded(self) -> bool:
        strategy = getattr(self._backend_obj, "sharding_strategy", None)
        return self.world_size > 1 and getattr(strategy, "name", "") != "NO_SHARD"

    def resident_parameter_bytes(self) -> int:
        # The original parameters are views into FlatParameters: count the flat storage
        # this rank holds (its shard, and the padded full buffer while it is allocated).
        total = 0
        for flat in self._flat_params():
            local = getattr(flat, "_local_shard", flat)
            total += local.numel() * local.element_size()
            padded = getattr(flat, "_full_param_padded", None)
            if isinstance(padded, torch.Tensor):
                total += padded.untyped_storage().nbytes()
        return total

    def num_parameters(self, trainable_only: bool = False) -> int:
        # The original parameters live inside FlatParameters; their sizes are recorded
        # there (``_numels``, shared parameters already counted once). With
        # use_orig_params=True the original Parameters keep their own requires_grad.
        total = 0
        for flat in self._flat_params():
            originals = getattr(flat, "_params", None)
            if originals is not None:
                flags = [p.requires_grad for p in originals]
            else:
                flags = [flat.requires_grad] * len(flat._numels)
            total += sum(n for n, rg in zip(flat._numels, flags, strict=True) if rg or not trainable_only)
        return total

    # -- weights in and out ----------------------------------------------------------
    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        # With use_orig_params=True each original parameter is a 1-D view of this
        # rank's slice outside of forward; its real shape is recorded in the FlatParameter.
        shapes: dict[int, tuple[int, ...]] = {}
        for flat in self._flat_params():
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

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        # A rank's slice of a FlatParameter runs across parameter boundaries: there is no shard of
        # each parameter to sync shard to shard, so copy_to gathers (each unit once).
        return None

    def layout_tensors(self) -> list[torch.Tensor] | None:
        return None

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        # use_orig_params=False: only FlatParameters are registered (``<module>._flat_param``);
        # the originals' names and shapes are recorded in each of them.
        out = super().param_shapes()
        for name, p in self.unwrap().named_parameters(remove_duplicate=False):
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

    # -- full parameters (gathered / generation / named_full_parameters) --------------
    def gather_bypass(self) -> Bypass:
        # FSDP1 stands in the module tree itself (a wrapper per unit), and its hooks and method
        # wrappers live in torch.distributed.fsdp.
        return Bypass(("torch.distributed.fsdp.",), peel=_unit_inside, flags_off=FSDP_MANAGED)

    @contextlib.contextmanager
    def gather_full(self, modifier_rank: int | None) -> Iterator[Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        group = self.process_group()
        flats = list(self._flat_params())
        # writeback copies each rank's own slice of its full copy back into its shard:
        # rank r's values are broadcast first; a failed body restores the saved shards.
        saved = [f.detach().clone() for f in flats] if modifier_rank is not None else []
        outcome = {"failed": False}

        replicas = self.replica_groups()

        def before_writeback(failed: bool) -> None:
            outcome["failed"] = failed
            if modifier_rank is not None and not failed:
                params = list(self._unique_parameters())
                broadcast_(params, modifier_rank, group, self.world_size)
                # HYBRID_SHARD: the first replica's values go to every replica, so the copies stay equal.
                for replica_group in replicas:
                    broadcast_(params, 0, replica_group, self.world_size)

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
        offloaded = getattr(getattr(self._backend_obj, "cpu_offload", None), "offload_params", False)
        fast = self._gather_in(dtypes) if modifier_rank is None and not offloaded else None
        handles = [self._cast_root_inputs()] if dtypes else []
        try:
            if fast is not None:
                yield lambda mod, name, p: fast.get(id(p))
                return
            assert self._backend_obj is not None
            with FullyShardedDataParallel.summon_full_params(
                self._backend_obj, recurse=True, writeback=modifier_rank is not None
            ), settle(before_writeback, modifier_rank is not None, group, self.world_size, replicas):
                yield replace if dtypes else None
        finally:
            for handle in handles:
                handle.remove()
            if modifier_rank is not None:
                with torch.no_grad():
                    if outcome["failed"]:
                        for f, old in zip(flats, saved, strict=True):
                            f.data.copy_(old)
                    else:
                        self.weights_written()

    def full_parameter_bytes(self) -> int:
        total = 0
        for unit in self._units():
            handle = getattr(unit, "_handle", None)
            if handle is not None:
                flat = handle.flat_param
                dtype = getattr(handle, "_fwd_bwd_param_dtype", None) or flat.dtype
                total += flat._unpadded_unsharded_size.numel() * dtype.itemsize
        return total

    @contextlib.contextmanager
    def gather_layerwise(self) -> Iterator[None]:
        # The inner units gather themselves in their forward. The root unit's parameters
        # (embeddings, final norm, head) are used by ``unwrap()``'s own code, outside any
        # unit's forward: they are unsharded here, as the root's forward would, in the dtype
        # it computes in, and resharded on exit. The root's lazy init runs first, so that
        # an inner unit never takes itself for the root.
        from torch.distributed.fsdp._runtime_utils import _lazy_init

        root: Any = self._backend_obj
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

    def load_pieces(self) -> list[Piece]:
        handles = [u._handle for u in self._units() if getattr(u, "_handle", None) is not None]
        return flat_pieces(self.unwrap(), handles)

    def _gather_in(self, dtypes: dict[int, torch.dtype]) -> dict[int, torch.nn.Parameter] | None:
        """Every original parameter, full, in its unit's compute dtype, from one all-gather of all
        the units' shards; None where that layout does not hold (use_orig_params=False, NO_SHARD,
        units computing in different dtypes): summon_full_params serves those."""
        units = [u for u in self._units() if getattr(u, "_handle", None) is not None]
        return gather_in(units, dtypes, self.process_group(), self.world_size)

    def _cast_root_inputs(self) -> Any:
        """FSDP1's root casts floating inputs to ``param_dtype`` (``cast_root_forward_inputs``); the
        same cast, as a hook of ours on the module ``bypassed`` runs, since FSDP's is taken out."""
        from torch.distributed.utils import _cast_forward_inputs

        policy = getattr(self._backend_obj, "mixed_precision", None)
        dtype = getattr(policy, "param_dtype", None) if getattr(policy, "cast_root_forward_inputs", False) else None

        def cast(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            return _cast_forward_inputs(dtype, *args, **kwargs)
        return self.unwrap().register_forward_pre_hook(cast, with_kwargs=True)

    def _sharded_units(self) -> list[Any] | None:
        """The units with parameters, where one all-gather of their shards serves any set of them
        (``gather_in``: use_orig_params=True, sharded, shards on the compute device); else None."""
        units = [u for u in self._units() if getattr(u, "_handle", None) is not None]
        offloaded = getattr(getattr(self._backend_obj, "cpu_offload", None), "offload_params", False)
        if (offloaded or self.world_size < 2
                or any(u._handle.flat_param._params is None or not u._handle.uses_sharded_strategy for u in units)):
            return None
        shards = [local_shard(u._handle.flat_param) for u in units]
        return units if len({(s.dtype, s.device) for s in shards}) <= 1 else None

    def gather_units(self) -> list[list[torch.nn.Parameter]] | None:
        # A unit's FlatParameter is the smallest thing FSDP1 gathers: its original parameters go together.
        units = self._sharded_units()
        return None if units is None else [list(u._handle.flat_param._params) for u in units]

    def gather_many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        units = self._sharded_units()
        assert units is not None, "gather_many needs gather_units()"
        wanted = {id(p) for p in params}
        units = [u for u in units if any(id(p) in wanted for p in u._handle.flat_param._params)]
        full = gather_in(units, {}, self.process_group(), self.world_size)
        assert full is not None
        for p in params:
            yield p, full[id(p)].detach()

    def gather_each(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One FSDP unit at a time: a unit's FlatParameter is the smallest thing FSDP1 gathers.
        from torch.distributed.fsdp import FullyShardedDataParallel

        names: dict[int, list[str]] = {}
        for name, p in self.unwrap().named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(canonical_name(name))
        units = [u for u in self._units() if getattr(u, "_handle", None) is not None]
        if any(getattr(u._handle.flat_param, "_params", None) is None for u in units):
            # use_orig_params=False: the originals are not Parameters; gather the whole model.
            with self.gather_full(None) as replace, bypassed(self.unwrap(), self.gather_bypass(), replace) as inner:
                batch = [(canonical_name(n), p.detach().clone())
                         for n, p in inner.named_parameters(remove_duplicate=False)]
            yield from batch
            return
        for unit in units:
            flat = unit._handle.flat_param
            if self.world_size > 1 and unit._handle.uses_sharded_strategy and hasattr(flat, "_local_shard"):
                yield from full_from_shards(flat, names, self.process_group(), self.world_size, self.rank)
                continue
            with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
                # Copied out before the unit is resharded, so nothing collective is pending at a yield.
                batch = [(n, p.detach().clone()) for p in flat._params for n in names.get(id(p), [])]
            yield from batch

    # -- placement and freezing (place / to_eval_frozen) -------------------------------
    def move(self, target: torch.device, copy: bool) -> None:
        # Each unit's FlatParameter holds this rank's shard (``_local_shard`` aliases it at
        # rest); the original parameters are views into it and must be re-pointed.
        for unit in self._units():
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
        move_buffers(self._module, target, copy)

    def placement_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
        assert self._backend_obj is not None and fsdp_cls is not None
        for path, unit in self._backend_obj.named_modules():
            handle = getattr(unit, "_handle", None) if isinstance(unit, fsdp_cls) else None
            if handle is not None:
                yield f"{canonical_name(path) or '<root>'} (flat parameter shard)", handle.flat_param
        for name, buf in self._module.named_buffers():
            yield canonical_name(name), buf

    # -- likeness ------------------------------------------------------------------------------------
    def _like(self, module: torch.nn.Module, init_on: torch.device | None) -> torch.nn.Module:
        """``module`` wrapped per block with this root's group(s), strategy and mixed precision."""
        root: Any = self._backend_obj
        topology = self.topology()
        group, replicas, mesh = topology.group, topology.replicas, topology.mesh
        groups: dict[str, Any] = {"process_group": group}
        if replicas:
            # HYBRID_SHARD takes its two groups together: the mesh it was given, or (shard, replicate).
            groups = {"device_mesh": mesh} if mesh is not None else {"process_group": (group, *replicas)}
        return wrap_fsdp1(module, device=self.device, sharding_strategy=getattr(root, "sharding_strategy", None),
                          mixed_precision=getattr(root, "mixed_precision", None), init_on=init_on, **groups)

    def wrap_like(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        return self._like(module, init_on=None)

    def fresh_copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        with torch.device("meta"):
            model = skeleton(self)
        ref = self._like(model, init_on=self.device)
        src: Any = self._backend_obj
        # Sharded state dicts move shard to shard, one unit at a time: the full model is never built.
        with FullyShardedDataParallel.state_dict_type(src, StateDictType.SHARDED_STATE_DICT), \
                FullyShardedDataParallel.state_dict_type(ref, StateDictType.SHARDED_STATE_DICT):
            ref.load_state_dict(src.state_dict())
        copy_buffers(self.unwrap(keep_peft=False), model)
        return ref

    def frozen_parameters(self) -> Iterator[torch.nn.Parameter]:
        # The FlatParameter too: with use_orig_params=True forward runs through it.
        yield from super().frozen_parameters()
        yield from self._flat_params()


def wrap_fsdp1(module: torch.nn.Module, *, device: torch.device, init_on: torch.device | None = None,
               embedding_units: bool = True, **fsdp_kwargs: Any) -> torch.nn.Module:
    """FSDP1 for a frozen model: one unit per transformer block, on ``device``; with
    ``embedding_units`` also one per untied input/output embedding (see ``_fsdp1_wrap_policy``).
    ``init_on``: ``module`` is a meta skeleton to materialise there unit by unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if init_on is not None:
        # Meta skeleton: each unit gets real (uninitialised) storage only as it is sharded.
        fsdp_kwargs["param_init_fn"] = lambda m: m.to_empty(device=init_on, recurse=False)
    return FullyShardedDataParallel(
        module,
        auto_wrap_policy=_fsdp1_wrap_policy(module, block_classes(module), embedding_units),
        device_id=device,
        use_orig_params=True,
        **fsdp_kwargs,
    )


def _fsdp1_wrap_policy(module: torch.nn.Module, blocks: set[type[torch.nn.Module]], embedding_units: bool) -> Any:
    """Blocks, and with ``embedding_units`` untied input/output embeddings, each their own unit.

    FSDP1 leaves the root unit's parameters gathered after a forward without backward,
    which for a reference model is every forward; embeddings and head are the largest
    parameters outside the blocks, so giving them units keeps the reference sharded.
    (Tied embeddings must share a unit, so they stay in the root.)"""
    import functools

    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    get_in = getattr(module, "get_input_embeddings", None)
    get_out = getattr(module, "get_output_embeddings", None)
    extra: set[int] = set()
    emb_in = get_in() if callable(get_in) else None
    emb_out = get_out() if callable(get_out) else None
    if embedding_units and isinstance(emb_in, torch.nn.Module) and isinstance(emb_out, torch.nn.Module):
        if getattr(emb_in, "weight", None) is not getattr(emb_out, "weight", None):
            extra = {id(emb_in), id(emb_out)}
    if not blocks and not extra:
        return None
    kinds = tuple(blocks)

    def wrap(m: torch.nn.Module) -> bool:
        return (bool(kinds) and isinstance(m, kinds)) or id(m) in extra

    return functools.partial(lambda_auto_wrap_policy, lambda_fn=wrap)


def _unit_inside(child: torch.nn.Module) -> torch.nn.Module:
    """The module an FSDP unit wraps (through nested units); any other module itself."""
    fsdp_cls = lookup("torch.distributed.fsdp", "FullyShardedDataParallel")
    while fsdp_cls is not None and isinstance(child, fsdp_cls):
        inner = child._fsdp_wrapped_module
        assert isinstance(inner, torch.nn.Module)
        child = inner
    return child
