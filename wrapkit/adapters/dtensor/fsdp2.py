"""FSDP2 (``fully_shard``): no wrapper object; the module's class becomes an ``FSDPModule``
subclass and its parameters become ``DTensor`` shards over a device mesh.

Tensor parallelism beside it (``parallelize_module`` over the ``tp`` dimension of a (dp, tp) or
(replicate, shard, tp) mesh, then ``fully_shard`` over the others) leaves the layers it split on the
whole mesh, fully_shard's dimensions first (``_StridedShard`` where both split the same tensor
dimension), and the rest on fully_shard's own mesh. One copy of the model then lies over the shard
and tensor-parallel dimensions together: that is the group, and the ranks along ``tp`` share a batch."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..._gather import Bypass
from ..._imports import is_instance, lookup
from ..core.foreign import EXPERT_MESH, TRANSFORMERS_EXPERTS
from ..core.internals import DTENSOR, FSDP2_GROUPS, FSDP2_MODULE, FSDP2_STATE, FSDP_MANAGED, require_internals
from ..core.kinds import ShardedAdapter
from ..core.likeness import ShardedLikeness, copy_buffers, distributed_copy, skeleton
from ..core.parts import Parts, lacking
from ..core.recipes import Recipe, Setting, dp_tp_mesh, tensor_parallel, two_d_mesh
from ..core.topology import Role, Topology
from .layout import (
    TP_HOOKS,
    Layout,
    flat_group,
    is_dtensor,
    mesh_device,
    mesh_key,
    readable,
    refuse_tp_adapters,
)
from .parts import dtensor_parts
from .sharding import _beside, _cast_hooks, fully_shard_per_block, param_groups, shard_fsdp2, unit_groups


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device, topology, half = setting.device, setting.topology, setting.half
    if topology == "hsdp":
        mesh = two_d_mesh(device)
    elif topology in ("tp", "hsdp-tp"):
        full = dp_tp_mesh(device, hsdp=topology == "hsdp-tp")
        model = tensor_parallel(model.to(device), full["tp"])
        mesh = full["dp"] if topology == "tp" else full["replicate", "shard"]
    elif topology == "submesh":
        mesh = two_d_mesh(device)["shard"]
    else:
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mp = {} if half is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)}
    return fully_shard_per_block(model.to(device), mesh, **mp)


class FSDP2Adapter(ShardedAdapter):
    name = "fsdp2"
    peels = False
    distributed = True
    # Experts split over an 'ep' mesh dimension of the same ranks (transformers' ep_size beside fsdp_size):
    # DTensors like the rest, on a mesh of their own (``unsupported_dtensor`` checks it spans these ranks).
    reads_marks: ClassVar[tuple[str, ...]] = (TRANSFORMERS_EXPERTS, EXPERT_MESH)
    recipe = Recipe(("fsdp2",), _build, order=4, topologies=frozenset({"hsdp", "submesh", "tp", "hsdp-tp"}))

    @classmethod
    def matches(cls, obj: object) -> bool:
        return is_instance(obj, "torch.distributed.fsdp", "FSDPModule")

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        return obj

    def _own_mesh(self) -> Any:
        # FSDP2's own record first: inside gathered() the module holds plain full copies, and
        # a mesh read off the parameters would be gone (and rank/world_size with it).
        for _, state in self._fsdp_states():
            for group in param_groups(state):
                mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
                if mesh is not None:
                    return mesh
        for p in self._innermost.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
        return None

    def _layout(self) -> Layout | None:
        """How the parameters lie on the mesh, read off FSDP2's own sharded parameters (inside
        ``gathered()`` the module holds plain full copies)."""
        for _, state in self._fsdp_states():
            for group in param_groups(state):
                for fsdp_param in group.fsdp_params:
                    return Layout.of(fsdp_param.sharded_param)
        return next((Layout.of(p) for p in self._innermost.parameters() if is_dtensor(p)), None)

    @functools.cached_property
    def _tp_mesh(self) -> Any:
        """The mesh of the parameters tensor parallelism split before fully_shard sharded them (its
        dimensions fully_shard's, then the tensor-parallel ones), else None. Read off FSDP2's own sharded
        parameters and kept: inside ``gathered()`` the module holds plain full copies."""
        own = self._own_mesh()
        meshes = (fsdp_param.sharded_param.device_mesh for _, state in self._fsdp_states()
                  for group in param_groups(state) for fsdp_param in group.fsdp_params)
        return next((m for m in meshes if own is not None and m.ndim > own.ndim and not _experts_mesh(m)), None)

    def topology(self) -> Topology:
        ep = self._ep_mesh
        return self._topology if ep is None else self._topology.with_experts(ep.get_group("ep"))

    @functools.cached_property
    def _ep_mesh(self) -> Any:
        """The mesh of the experts split over their own ranks ('ep' dimension), else None; kept from adapt()."""
        meshes = (fsdp_param.sharded_param.device_mesh for _, state in self._fsdp_states()
                  for group in param_groups(state) for fsdp_param in group.fsdp_params)
        return next((m for m in meshes if _experts_mesh(m)), None)

    @functools.cached_property
    def _topology(self) -> Topology:
        # Read once: inside ``gathered()`` the module holds plain full copies, and the groups' ranks are
        # asked of torch. Beside tensor parallelism, fully_shard's dimensions keep their roles (HSDP's
        # replicate, then shard) and the ones after them are tensor parallel: one copy lies over shard
        # and tp together.
        mesh = self._tp_mesh
        if mesh is not None:
            own = self._own_mesh().ndim
            roles = (Role.REPLICATE,) * (own - 1) + (Role.SHARD,) + (Role.TENSOR,) * (mesh.ndim - own)
            group = flat_group(mesh, tuple(range(own - 1, mesh.ndim)))
            replicas = tuple(mesh.get_group(d) for d in range(own - 1))
            return Topology(group, replicas, mesh, roles, mesh.get_group(own), self._context_group(group))
        layout = self._layout()
        if layout is None:
            return Topology(None, (), self._own_mesh())
        roles = tuple(Role.SHARD if d in layout.shard_dims else Role.REPLICATE for d in range(layout.mesh.ndim))
        group = layout.shard_group()
        return Topology(group, tuple(layout.replica_groups()), self._own_mesh(), roles,
                        cp_group=self._context_group(group))

    def _context_group(self, group: Any) -> Any:
        """The ranks of a context-parallel dimension (``cp``, as accelerate and torchtitan name it) that the
        mesh given to fully_shard folds in (accelerate shards over ``dp_shard_cp``): they split the sequence
        of one batch. None where there is none."""
        own = self._own_mesh()
        root_of = getattr(own, "_get_root_mesh", None)
        root = root_of() if root_of is not None else None
        names = tuple(getattr(root, "mesh_dim_names", None) or ())
        if root is None or root is own or "cp" not in names or root.size(names.index("cp")) <= 1:
            return None
        cp = root.get_group("cp")
        inside = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        # A dimension the model is not sharded over: its ranks hold copies.
        return cp if set(dist.get_process_group_ranks(cp)) <= inside else None

    def _check_stack(self) -> None:
        if self._tp_mesh is not None:
            refuse_tp_adapters(self.stack)

    def _check_internals(self) -> None:
        fsdp_module = lookup("torch.distributed.fsdp", "FSDPModule")
        modules = [m for m in self.module.modules() if fsdp_module is not None and isinstance(m, fsdp_module)]
        require_internals(modules, FSDP2_MODULE, "fully_shard modules", "torch")
        states = [state for _, state in self._fsdp_states()]
        require_internals(states, FSDP2_STATE, "FSDP states", "torch")
        for state in states:
            if not any(hasattr(state, n) for n in FSDP2_GROUPS):
                require_internals([state], FSDP2_GROUPS[:1], "FSDP states", "torch")
        dtensor = lookup("torch.distributed.tensor", "DTensor")
        shards = [p for p in self._innermost.parameters() if dtensor is not None and isinstance(p, dtensor)]
        require_internals(shards, DTENSOR, "DTensor parameters", "torch")

    def unsupported_dtensor(self, p: Any) -> str | None:
        # fully_shard's own layout: shards and replicas over the mesh it was given, and tensor
        # parallelism over one more dimension after it. Any other mesh, or a placement not made by
        # these two (Partial, a custom one), is beyond every read and write here.
        mesh = self._own_mesh()
        tp_mesh = self._tp_mesh
        meshes = [mesh_key(m) for m in (mesh, tp_mesh) if m is not None]
        names = getattr(tp_mesh, "mesh_dim_names", None)
        if mesh is not None and names:
            # After a forward that no backward followed, FSDP2 leaves the root's parameters unsharded:
            # those tensor parallelism split then lie on its dimension alone.
            meshes.append(mesh_key(tp_mesh[tuple(names[mesh.ndim:])]))
        if _experts_mesh(p.device_mesh) and mesh is not None:
            # Experts over their own ranks: read as any DTensor where the ranks are those of the rest (fully_shard's,
            # and tensor parallelism's beside it).
            if _ranks(p.device_mesh) != _ranks(tp_mesh if tp_mesh is not None else mesh):
                return ("the experts lie on an 'ep' mesh over other ranks than fully_shard's mesh, a layout the "
                        "fsdp2 adapter cannot read")
            return None if readable(p) else "the experts' placements are a layout the fsdp2 adapter cannot read"
        if mesh_key(p.device_mesh) not in meshes:
            return (f"fully_shard was given a {getattr(mesh, 'ndim', 0)}-D mesh, and this parameter lies on "
                    "another one, a layout the fsdp2 adapter cannot read")
        if tp_mesh is not None and (why := _beside(mesh, tp_mesh)) is not None:
            return why
        from torch.distributed.tensor import Replicate, Shard

        strided = lookup("torch.distributed.tensor.placement_types", "_StridedShard")
        if not all(type(x) in (Shard, Replicate, strided) for x in p.placements):
            return "placements other than Shard and Replicate are a layout the fsdp2 adapter cannot read"
        return None

    def _fsdp_states(self) -> Iterator[tuple[Any, Any]]:
        """(module, its FSDP state) for every module ``fully_shard`` was applied to."""
        fsdp_module = lookup("torch.distributed.fsdp", "FSDPModule")
        for m in self.module.modules():
            if fsdp_module is not None and isinstance(m, fsdp_module):
                fsdp: Any = m
                yield fsdp, fsdp._get_fsdp_state()

    @staticmethod
    def _compute_dtypes(states: list[tuple[Any, Any]]) -> dict[int, torch.dtype]:
        """id(sharded parameter) -> the ``param_dtype`` of its ``MixedPrecisionPolicy``, where
        that is not its own dtype: what FSDP2 all-gathers it in and computes with."""
        out: dict[int, torch.dtype] = {}
        for _, state in states:
            for group in param_groups(state):
                dtype = group.mp_policy.param_dtype
                for fsdp_param in group.fsdp_params:
                    p = fsdp_param.sharded_param
                    if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                        out[id(p)] = dtype
        return out

    @property
    def device(self) -> torch.device:
        state: Any = None
        get_state = getattr(self._backend_obj, "_get_fsdp_state", None)
        if get_state is not None:
            state = get_state()
        dev = getattr(state, "_device", None)
        if isinstance(dev, torch.device):
            return dev
        return mesh_device(self._own_mesh()) or torch.device("cpu")

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    def parts(self) -> Parts:
        # FSDP2's pre/post-forward hooks on every fully_shard module, and the method wrappers of
        # register_fsdp_forward_method, live in torch.distributed.fsdp; tensor parallelism's
        # redistribution of inputs and outputs in torch's hooks or transformers' replaced forwards.
        def bypass() -> Bypass:
            tp = TP_HOOKS if self._tp_mesh is not None else ()
            # transformers' expert parallelism replaces the experts' forward with a dispatch to their ranks,
            # and sets their count to this rank's; the full experts run the class's forward over all of them.
            ep = (EP_FORWARDS,) if any(_expert_parallel(m) for m in self.module.modules()) else ()
            return Bypass(("torch.distributed.fsdp.", *tp, *ep), flags_off=FSDP_MANAGED, attrs=_whole_experts)

        def cast_hooks() -> list[Any]:
            return [h for m, state in self._fsdp_states() for h in _cast_hooks(m, state)]

        return dtensor_parts(self, bypass, reshard=self._reshard,
                             compute_dtypes=lambda: self._compute_dtypes(list(self._fsdp_states())),
                             cast_hooks=cast_hooks).replace(likeness=_Fsdp2Likeness(self))

    def _reshard(self) -> None:
        """Every unit back to its shards. After a forward that no backward followed, FSDP2 keeps
        the root's parameters unsharded: registered in their place are full copies in the
        compute dtype (rounded, under mixed precision), whose storage the next reshard frees.
        Every read and write of the weights starts from the shards, where the values live."""
        for m, _ in self._fsdp_states():
            m.reshard()


# Where transformers' expert parallelism puts the experts' replaced forward.
EP_FORWARDS = "transformers.distributed.expert_parallel."


def _experts_mesh(mesh: Any) -> bool:
    return "ep" in (getattr(mesh, "mesh_dim_names", None) or ())


def _ranks(mesh: Any) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


def _expert_parallel(module: torch.nn.Module) -> bool:
    return module.__dict__.get("_is_expert_parallel") is True


def _whole_experts(module: torch.nn.Module) -> dict[str, Any]:
    """For a module of experts split over ranks, the count of all of them (its parameters' first dimension)."""
    if not _expert_parallel(module) or not isinstance(module.__dict__.get("num_experts"), int):
        return {}
    first = next(iter(module.parameters(recurse=False)), None)
    return {} if first is None else {"num_experts": int(first.shape[0])}


class _Fsdp2Likeness(ShardedLikeness["FSDP2Adapter"]):
    """Copies sharded where the policy is (its own units; per transformer block where they cannot be matched), on
    the policy's mesh, with its root's mixed precision."""

    def _like(self, module: torch.nn.Module) -> torch.nn.Module:
        model = self.model
        if model._tp_mesh is not None:
            raise lacking(model.name, "likeness.wrap", why=", because tensor parallelism beside fully_shard keeps "
                          "no record of its plan on the model")
        root: Any = model.backend_object
        state = root._get_fsdp_state() if hasattr(root, "_get_fsdp_state") else None
        mp = getattr(state, "_mp_policy", None)
        return shard_fsdp2(module, model._own_mesh(), unit_groups(root),
                           **({"mp_policy": mp} if mp is not None else {}))

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        module.to(self.model.device)
        return self._like(module)

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        policy = self.model
        if policy._tp_mesh is not None or policy._ep_mesh is not None:
            policy._reshard()  # copied shard to shard: every parameter in its sharded layout
            copied = distributed_copy(policy)
            if copied is not None:
                return copied
            if policy._ep_mesh is not None:  # the experts' own mesh is not fully_shard's: no skeleton copies it
                raise lacking(policy.name, "likeness.copy", why=", because experts split over their own ranks by "
                              "hand keep no record of how (split the reference the same way)")
        with torch.device("meta"):
            model = skeleton(policy)
        ref = self._like(model)
        model.to_empty(device=policy.device)
        # Every parameter a DTensor to copy from, not the full copies a no-grad forward leaves.
        policy._reshard()
        inner = policy.unwrap(keep_peft=False)
        theirs = dict(inner.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                # Same mesh and placements: a local copy of this rank's shard, nothing gathered.
                p.copy_(theirs[name])
        copy_buffers(inner, model)
        return ref














