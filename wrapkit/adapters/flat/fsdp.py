"""FSDP1 (``FullyShardedDataParallel``): parameters flattened into one ``FlatParameter``
per wrapped unit, each rank holding a slice of it."""

from __future__ import annotations

from typing import Any

import torch

from ..._imports import is_instance
from ..._names import canonical_name
from ..core.internals import FSDP1_FLAT, FSDP1_HANDLE, FSDP1_UNIT, require_internals
from ..core.kinds import ShardedAdapter
from ..core.likeness import ShardedLikeness, block_classes, copy_buffers, resolve_units, skeleton
from ..core.parts import Parts
from ..core.recipes import Recipe, Setting, two_d_mesh
from ..core.topology import Role, Topology
from .flat_param import flat_parameter_names
from .parts import flat_parts
from .parts import units as fsdp_units


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device, topology = setting.device, setting.topology
    blocks = block_classes(model)
    kwargs: dict[str, Any] = {}
    if setting.half is not None:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=setting.half, reduce_dtype=torch.float32)
    if topology == "hsdp":
        kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=two_d_mesh(device))
    elif topology == "hybrid-zero2":
        kwargs.update(sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2, device_mesh=two_d_mesh(device))
    elif topology == "hybrid-groups":
        mesh = two_d_mesh(device)
        kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                      process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
    return FullyShardedDataParallel(model, device_id=device, use_orig_params=True,
                                    auto_wrap_policy=ModuleWrapPolicy(blocks) if blocks else None, **kwargs)


class FSDPAdapter(ShardedAdapter):
    name = "fsdp"
    distributed = True
    recipe = Recipe(("fsdp",), _build, order=3, topologies=frozenset({"hsdp", "hybrid-groups", "hybrid-zero2"}))

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.distributed.fsdp", "FullyShardedDataParallel")

    def _check_internals(self) -> None:
        # FSDP1 has no public per-parameter API: the fields ``flat/parts.py`` and ``flat/flat_param.py`` read
        # (``_shapes``, ``_numels``, ``_fqns``, ``_params``, ``_local_shard``, ...) are documented on
        # ``FlatParameter`` in torch/distributed/fsdp/_flat_param.py, and checked here.
        units = list(fsdp_units(self._backend_obj))
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
        roles = () if mesh is None else (Role.REPLICATE, Role.SHARD)[-mesh.ndim:]
        return Topology(getattr(root, "process_group", None), replicas, mesh, roles)

    @property
    def device(self) -> torch.device:
        dev = getattr(self._backend_obj, "compute_device", None)
        return dev if isinstance(dev, torch.device) else super().device

    @property
    def is_sharded(self) -> bool:
        strategy = getattr(self._backend_obj, "sharding_strategy", None)
        return self.world_size > 1 and getattr(strategy, "name", "") != "NO_SHARD"

    def parts(self) -> Parts:
        return flat_parts(self).replace(likeness=_Fsdp1Likeness(self))

    def parameter_names(self) -> dict[int, list[str]]:
        return flat_parameter_names(self.module)


class _Fsdp1Likeness(ShardedLikeness["FSDPAdapter"]):
    """Copies wrapped where the policy is (its own units; per transformer block where they cannot be matched), with
    the policy root's group(s), strategy and mixed precision."""

    def _like(self, module: torch.nn.Module, init_on: torch.device | None) -> torch.nn.Module:
        model = self.model
        root: Any = model.backend_object
        topology = model.topology()
        group, replicas, mesh = topology.group, topology.replicas, topology.mesh
        groups: dict[str, Any] = {"process_group": group}
        if replicas:
            # HYBRID_SHARD takes its two groups together: the mesh it was given, or (shard, replicate).
            groups = {"device_mesh": mesh} if mesh is not None else {"process_group": (group, *replicas)}
        unit_ids = {id(u) for u in fsdp_units(root)}
        units = [[canonical_name(p)] for p, m in root.named_modules() if p and id(m) in unit_ids]
        return wrap_fsdp1(module, device=model.device, sharding_strategy=getattr(root, "sharding_strategy", None),
                          mixed_precision=getattr(root, "mixed_precision", None), init_on=init_on, units=units,
                          **groups)

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        return self._like(module, init_on=None)

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        with torch.device("meta"):
            model = skeleton(self.model)
        ref = self._like(model, init_on=self.model.device)
        src: Any = self.model.backend_object
        # Sharded state dicts move shard to shard, one unit at a time: the full model is never built.
        with FullyShardedDataParallel.state_dict_type(src, StateDictType.SHARDED_STATE_DICT), \
                FullyShardedDataParallel.state_dict_type(ref, StateDictType.SHARDED_STATE_DICT):
            ref.load_state_dict(src.state_dict())
        copy_buffers(self.model.unwrap(keep_peft=False), model)
        return ref


def wrap_fsdp1(module: torch.nn.Module, *, device: torch.device, init_on: torch.device | None = None,
               embedding_units: bool = True, units: list[list[str]] | None = None,
               **fsdp_kwargs: Any) -> torch.nn.Module:
    """FSDP1 for a frozen model, on ``device``: one unit per module of ``units`` (a policy's units, by canonical
    path), else per transformer block; with ``embedding_units`` also one per untied input/output embedding
    (see ``_fsdp1_wrap_policy``). ``init_on``: ``module`` is a meta skeleton to materialise there unit by unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if init_on is not None:
        # Meta skeleton: each unit gets real (uninitialised) storage only as it is sharded.
        fsdp_kwargs["param_init_fn"] = lambda m: m.to_empty(device=init_on, recurse=False)
    return FullyShardedDataParallel(
        module,
        auto_wrap_policy=_fsdp1_wrap_policy(module, block_classes(module), embedding_units,
                                            resolve_units(module, units or [])),
        device_id=device,
        use_orig_params=True,
        **fsdp_kwargs,
    )


def _fsdp1_wrap_policy(module: torch.nn.Module, blocks: set[type[torch.nn.Module]], embedding_units: bool,
                       units: list[list[torch.nn.Module]] | None = None) -> Any:
    """The modules of ``units`` (else blocks), and with ``embedding_units`` untied input/output embeddings, each
    their own unit.

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
    chosen = {id(m) for group in units for m in group} if units is not None else set()
    kinds = tuple(blocks) if units is None else ()
    if not kinds and not extra and not chosen:
        return None

    def wrap(m: torch.nn.Module) -> bool:
        return (bool(kinds) and isinstance(m, kinds)) or id(m) in extra or id(m) in chosen

    return functools.partial(lambda_auto_wrap_policy, lambda_fn=wrap)
