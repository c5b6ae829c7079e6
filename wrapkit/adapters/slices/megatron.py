"""Megatron-Core: a model built from Megatron's parallel layers (``GPTModel``), bare, in Megatron's
``Float16Module`` or its ``DistributedDataParallel``, split over tensor-parallel ranks (each keeps its slice of a
layer in a plain tensor, ``slices/parts.py``) and pipeline stages (each holds some of the layers, numbered
from 0 on every stage), with data parallelism over the copies.

The groups are the model's own (``pg_collection``, which Megatron hands every layer). The whole model's names
are Megatron's, with each layer under its global number (``layer_number``, which Megatron keeps): a stage's
``decoder.layers.0`` is the whole model's ``decoder.layers.{offset}``. Pipeline stages go through the stage
parts (``stages/plan.py``), which walk every stage's tensors in one plan; the Hub's layout is
``formats/megatron.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import sys
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from ..._errors import UnsupportedModelError
from ..._imports import lookup
from ...formats.hub import hub_tensors
from ...formats.megatron import MegatronLayout, megatron_settings
from ..core.foreign import MEGATRON_LAYERS, MEGATRON_STAGES
from ..core.kinds import ShardedAdapter
from ..core.likeness import ShardedLikeness
from ..core.parts import Parts, lacking
from ..core.recipes import Recipe, Setting
from ..core.topology import Topology
from ..stages.parts import stage_parts
from ..stages.plan import Stage, StagePlan
from .parts import megatron_parts, own_slice

__all__ = ["MegatronAdapter", "megatron_module"]

_WRAPPERS = (("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel"),
             ("megatron.core.transformer.module", "Float16Module"))
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"
_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def _global_expert(name: str, first: int) -> str:
    """``name`` with its local expert number (if any) turned global: ``first`` is this rank's first expert."""
    if not first:
        return name
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first}.", name, count=1)


def megatron_module(obj: object) -> bool:
    """Whether ``obj`` is a Megatron-Core module (no import: Megatron loaded it if it is one)."""
    base = lookup("megatron.core.transformer.module", "MegatronModule")
    return base is not None and isinstance(obj, base)


def _wrapper(obj: object) -> bool:
    return any((cls := lookup(mod, name)) is not None and isinstance(obj, cls) for mod, name in _WRAPPERS)


class _Groups(NamedTuple):
    tp: Any
    pp: Any
    dp: Any
    ep: Any = None  # the experts' own split: expert parallel, and expert tensor parallel
    etp: Any = None

    def size(self, group: Any) -> int:
        return 1 if group is None else dist.get_world_size(group)


def _build(layer: str, model: torch.nn.Module, setting: Setting) -> torch.nn.Module:
    """A transformers Llama, Qwen2 or Qwen3 as the Megatron-Core ``GPTModel`` of its architecture, with its weights:
    split over two tensor-parallel ranks (one where the world size is odd), data parallel over the others, in
    Megatron's DDP on CUDA (over its ``Float16Module`` in 16 bits). Megatron's parallel state is set up anew."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    settings, arguments = megatron_settings(model.config)
    experts = int(settings.get("num_moe_experts") or 0)
    even = dist.get_world_size() % 2 == 0
    # A mixture splits its experts instead: Megatron takes tensor parallelism beside experts only with sequence
    # parallelism.
    tp = 2 if even and not experts and settings["num_query_groups"] % 2 == 0 else 1
    ep = 2 if even and experts % 2 == 0 and experts else 1
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if setting.device.type == "cuda":
        model_parallel_cuda_manual_seed(0)  # the generators Megatron's forward forks
    dtype = setting.half or torch.float32
    config = TransformerConfig(**settings, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                               use_cpu_initialization=True,
                               params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                               fp16=dtype == torch.float16)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=settings["qk_layernorm"])
    gpt = GPTModel(config, spec, **arguments)
    # Each expert-parallel rank holds its own experts under local numbers: their values are the Hub's experts
    # from this rank's first on.
    first = ps.get_expert_model_parallel_rank() * (experts // ep)
    params = [(_global_expert(name, first), p) for name, p in gpt.named_parameters()]
    values = MegatronLayout(gpt).from_hub(hub_tensors(model), [name for name, _ in params])
    group = ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        for name, p in params:
            p.copy_(own_slice(p, values[name], group))
    gpt.to(setting.device)
    inner: torch.nn.Module = Float16Module(config, gpt) if setting.half is not None else gpt
    if setting.device.type != "cuda":
        return inner  # Megatron's DDP allocates its gradient buffers on the current CUDA device
    wrapped: torch.nn.Module = DistributedDataParallel(config, DistributedDataParallelConfig(), inner)
    return wrapped


class MegatronAdapter(ShardedAdapter):
    name = "megatron"
    recipe = Recipe(("megatron",), _build, order=11, needs="megatron.core")
    peels = True
    distributed = True
    reads_marks: ClassVar[tuple[str, ...]] = (MEGATRON_LAYERS, MEGATRON_STAGES)

    @classmethod
    def matches(cls, obj: object) -> bool:
        """Megatron's wrappers: its ``DistributedDataParallel`` and ``Float16Module``."""
        return _wrapper(obj)

    @classmethod
    def claims(cls, module: torch.nn.Module) -> bool:
        """A bare Megatron-Core model (no wrapper around it)."""
        return megatron_module(module)

    @classmethod
    def inner(cls, obj: torch.nn.Module) -> torch.nn.Module:
        # DDP(Float16Module(model)) is Megatron's own stack: both peeled as one backend.
        while _wrapper(obj):
            obj = obj.module  # type: ignore[assignment]
        return obj

    # -- groups ---------------------------------------------------------------------------
    @functools.cached_property
    def _groups(self) -> _Groups:
        found = getattr(self._innermost, "pg_collection", None)
        if found is not None:
            return _Groups(getattr(found, "tp", None), getattr(found, "pp", None),
                           getattr(found, "dp_cp", None) or getattr(found, "dp", None), getattr(found, "ep", None),
                           getattr(found, "expt_tp", None))
        # Before process-group collections, Megatron kept its groups in parallel_state.
        state: Any = sys.modules.get("megatron.core.parallel_state")
        if state is None or not state.model_parallel_is_initialized():
            raise UnsupportedModelError(
                f"{type(self._innermost).__name__} is a Megatron-Core model without its process groups "
                "(no pg_collection, and parallel_state is not initialised); adapt it while Megatron's model "
                "parallelism is initialised.")
        return _Groups(state.get_tensor_model_parallel_group(), state.get_pipeline_model_parallel_group(),
                       state.get_data_parallel_group(with_context_parallel=True),
                       state.get_expert_model_parallel_group(), state.get_expert_tensor_parallel_group())

    def _owners(self, group: Any) -> Stage | None:
        """``group``'s ranks as owners of parts of the whole model (the stage plan reads them), or None where it
        has one rank."""
        size = self._groups.size(group)
        return None if size == 1 else Stage(group, dist.get_rank(group), size, MEGATRON_STAGES)

    @functools.cached_property
    def _stage(self) -> Stage | None:
        return self._owners(self._groups.pp)

    @functools.cached_property
    def _experts_split(self) -> Stage | None:
        """Experts split over expert-parallel ranks, read as the stages are: each rank of the ep group holds its
        own experts (under their global numbers) beside the dense layers, which every rank holds; None without."""
        return self._owners(self._groups.ep)

    @functools.cached_property
    def _local_experts(self) -> int:
        """How many experts each expert-parallel rank holds."""
        cfg = getattr(self._innermost, "config", None)
        return int(getattr(cfg, "num_moe_experts", None) or 0) // self._groups.size(self._groups.ep)

    @functools.cached_property
    def _offset(self) -> int:
        """The global number of this stage's first layer (Megatron numbers them from 1)."""
        layers = getattr(getattr(self._innermost, "decoder", None), "layers", None)
        if not layers:
            return 0
        return int(getattr(layers[0], "layer_number", 1)) - 1

    def topology(self) -> Topology:
        g = self._groups
        tp = g.size(g.tp) > 1
        replicas = (g.dp,) if g.size(g.dp) > 1 else ()
        if tp:  # slices of each layer within a stage; the stages a dimension around them
            top = Topology(g.tp, replicas, None, tp_group=g.tp, pp_group=self._stage and self._stage.group)
        elif self._stage is not None:
            top = Topology(g.pp, replicas, None, pp_group=g.pp)
        else:
            top = Topology(g.dp, (), None)  # whole copies, like DDP
        return top if self._experts_split is None else top.with_experts(g.ep)

    @property
    def is_sharded(self) -> bool:
        g = self._groups
        return g.size(g.tp) > 1 or self._stage is not None or self._experts_split is not None

    def _check_stack(self) -> None:
        layers = [name for name, _ in self._entries if name == "peft"]
        if layers:
            raise UnsupportedModelError(
                "PEFT layers on a Megatron-Core model are not read yet; adapt the Megatron model without them.")
        self._check_experts()

    def _check_experts(self) -> None:
        """Refuse the expert splits not read yet: experts sliced over other ranks than the dense layers (expert
        tensor parallelism apart from tensor parallelism), expert parallelism beside pipeline stages, and grouped
        experts (one tensor for all of a rank's experts) split over expert-parallel ranks."""
        g = self._groups
        # Found by name: Megatron marks experts allreduce=False only when split over expert-parallel ranks, and
        # tensor_model_parallel even when they are whole on each rank.
        experts = [name for name, _ in self.named_live(buffers=False) if ".mlp.experts." in name]
        if not experts:
            return
        problems = []
        if not _same_ranks(g.etp, g.tp):
            problems.append(f"expert tensor parallel size {g.size(g.etp)} over other ranks than tensor parallel size "
                            f"{g.size(g.tp)}")
        if self._experts_split is not None and self._stage is not None:
            problems.append(f"expert parallel size {g.size(g.ep)} beside {self._stage.stages} pipeline stages")
        grouped = next((n for n in experts if not _LOCAL_EXPERT.search(n)), None)
        if self._experts_split is not None and grouped is not None:
            problems.append(f"grouped experts ({grouped}) split over {g.size(g.ep)} expert-parallel ranks")
        if problems:
            raise UnsupportedModelError(
                f"this Megatron-Core model's experts ({experts[0]}, ...) are split in a way wrapkit does not read yet: "
                f"{'; '.join(problems)}. Expert parallelism is read for one module per expert (moe_grouped_gemm="
                "False) without pipeline stages, the experts sliced over the tensor-parallel ranks; otherwise export "
                "it with Megatron-Core's dist_checkpointing.")

    # -- names: each layer under its global number --------------------------------------------
    def named_live(self, parameters: bool = True, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        offset = self._offset
        tied = bool(getattr(self._innermost, "share_embeddings_and_output_weights", False))
        split = self._experts_split
        first = 0 if split is None else split.number * self._local_experts  # this rank's first expert
        for name, t in super().named_live(parameters, buffers):
            if offset:
                name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name, count=1)
            name = _global_expert(name, first)
            if tied and name == "output_layer.weight":
                # A tied head on another stage than the embedding is Megatron's copy of it, kept equal by an
                # all-reduce of their gradients: the whole model has one tensor, which loads fill on both.
                name = _EMBEDDING
            yield name, t

    def parts(self) -> Parts:
        g = self._groups
        inner = megatron_parts(self, g.tp if g.size(g.tp) > 1 else None).replace(likeness=_MegatronLikeness(self))
        stage = self._stage or self._experts_split  # both together are refused (_check_experts)
        if stage is None:
            return inner
        buffers = [(name, tuple(b.shape)) for name, b in self.named_live(parameters=False)]
        keys = [name for name, _ in self.named_live()]
        params = list(self.named_live(buffers=False))
        plan = StagePlan.read(stage, inner.weights, self.unwrap(), buffers, keys, params)
        return stage_parts(self, inner, plan).replace(likeness=inner.likeness, states=inner.states)

    def hub_layout(self) -> MegatronLayout:
        return MegatronLayout.of(self._innermost)


class _MegatronLikeness(ShardedLikeness["MegatronAdapter"]):
    """Frozen copies of a Megatron model: the model copied as it is, split the same way over the same groups
    (its parallel layers hold the groups, which a copy shares), outside Megatron's DDP and Float16Module, which
    only serve training. A module wrapped another way cannot become one: Megatron builds its layers split."""

    def wrap(self, module: torch.nn.Module, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        raise lacking(self.model.name, "likeness.wrap", why=", because Megatron-Core builds its layers already split "
                      "over its groups")

    def copy(self, ds_config: dict[str, Any] | None) -> torch.nn.Module:
        source = self.model._innermost
        # Process groups cannot be copied: the copy shares every one its layers hold.
        memo: dict[int, Any] = {id(g): g for g in _groups_held(source)}
        clone = copy.deepcopy(source, memo)
        # A copied Parameter keeps no attributes, and Megatron's marks of the split are attributes
        # (tensor_model_parallel, partition_dim, ...). Plain values only: DDP's main_grad stays behind.
        for mine, theirs in zip(source.parameters(), clone.parameters(), strict=True):
            theirs.__dict__.update({k: v for k, v in vars(mine).items() if isinstance(v, (bool, int, float, str))})
        return clone


def _same_ranks(a: Any, b: Any) -> bool:
    """Whether groups ``a`` and ``b`` (None: this rank alone) hold the same ranks."""
    def ranks(g: Any) -> list[int]:
        return [dist.get_rank()] if g is None or dist.get_world_size(g) == 1 else dist.get_process_group_ranks(g)
    return ranks(a) == ranks(b)


def _groups_held(root: torch.nn.Module) -> Iterator[Any]:
    """Every process group ``root``'s modules hold, directly or in a collection of them (``pg_collection``)."""
    group_type = dist.ProcessGroup
    for module in root.modules():
        for value in vars(module).values():
            if isinstance(value, group_type):
                yield value
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                yield from (v for v in vars(value).values() if isinstance(v, group_type))
