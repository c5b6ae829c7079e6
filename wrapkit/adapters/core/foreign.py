"""Partitioning another framework applied to a model itself, which no adapter reads yet.

A pipeline stage holds only its own layers, an expert-parallel rank only its own experts, a Megatron-Core
rank only its slices, all in plain tensors. Taken for a plain model, each rank's part would pass for the
whole one: exports would be silently incomplete and loads would write the wrong slices. ``foreign_marks``
finds what these frameworks leave on the model, and ``adapt()`` refuses a model that carries any, naming
the parameter or module, the mark and the fix (``tests/adapters/test_foreign.py`` lists each mark with its producer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._errors import UnsupportedModelError
from ..._names import canonical_name

__all__ = ["Mark", "foreign_marks", "refuse_foreign", "CUT_STAGE", "RENUMBERED_STAGE", "TRANSFORMERS_STAGES",
           "TRANSFORMERS_EXPERTS", "EXPERT_MESH", "MEGATRON_LAYERS", "MEGATRON_STAGES"]

# The producers of pipeline marks that the pipeline adapter reads where it knows the stage (``stages/plan.py``).
TRANSFORMERS_STAGES = "transformers' DistributedConfig(pp_size=...)"
CUT_STAGE = "a pipeline stage built by deleting layers (torch.distributed.pipelining, torchtitan)"
# Not read: a ModuleList that lost layers renumbers the rest from 0, so names no longer say which layer is which.
RENUMBERED_STAGE = "a pipeline stage built by deleting layers from a ModuleList, which renumbers the rest"

# The producers of expert marks that the fsdp2 adapter reads where the experts' mesh spans its own ranks.
TRANSFORMERS_EXPERTS = "transformers' DistributedConfig(ep_size=...)"
EXPERT_MESH = "a device mesh with an 'ep' dimension (experts over their own ranks)"

# The producers of Megatron-Core's marks, which the megatron adapter reads.
MEGATRON_LAYERS = "Megatron-Core's parallel layers"
MEGATRON_STAGES = "Megatron-Core"

# Mesh dimensions that split a model in a way no adapter reads: stages, and experts over their own ranks.
_FOREIGN_DIMS = {"pp": "pipeline stages", "ep": "experts"}

# The first and last modules of a decoder, which a pipeline split empties on the stages that lack them.
_ENDS = {"tok_embeddings", "embed_tokens", "norm", "output", "lm_head", "final_layernorm"}

# What a user can do about each kind of partitioning today.
_FIXES = {
    "pipeline": "load the model with transformers' DistributedConfig(pp_size=...) alone (wrapkit reads its "
                "stages), or without pipeline stages (FSDP2 or tensor parallelism shard it in a way wrapkit reads)",
    "experts": "split the experts with transformers' DistributedConfig(fsdp_size=..., ep_size=...) or an 'ep' mesh "
               "dimension over the ranks fully_shard shards the rest over (wrapkit reads those), or shard them with "
               "FSDP2 or ZeRO-3",
    "megatron": "adapt the Megatron-Core model itself (a GPTModel, or Megatron's DistributedDataParallel around "
                "it), which wrapkit reads; Megatron's parallel layers inside another module are not read, so export "
                "those with Megatron-Core's own tools (dist_checkpointing)",
}


class Mark(NamedTuple):
    """``where`` (a parameter or module, canonical name) carries ``what``, left by ``producer``; ``kind``
    is a key of ``_FIXES``."""

    where: str
    what: str
    producer: str
    kind: str


def foreign_marks(model: torch.nn.Module) -> list[Mark]:
    """Every mark of another framework's partitioning on ``model``, in module order."""
    marks: list[Mark] = []
    for path, module in model.named_modules():
        at = canonical_name(path) or type(module).__name__
        cls = type(module)
        if cls.__name__ == "PipelineIdentityLayer":
            marks.append(Mark(at, "a placeholder for a layer another pipeline stage holds (PipelineIdentityLayer)",
                              TRANSFORMERS_STAGES, "pipeline"))
        if getattr(module, "_is_expert_parallel", False) is True:
            marks.append(Mark(at, f"{getattr(module, 'num_experts', '?')} experts of this rank's only "
                              "(_is_expert_parallel)", TRANSFORMERS_EXPERTS, "experts"))
        pre, post = getattr(module, "pre_process", None), getattr(module, "post_process", None)
        if cls.__module__.startswith("megatron.") and (pre is False or post is False):
            lacks = " or ".join(what for what, flag in (("the embedding", pre), ("the final norm and head", post))
                                if flag is False)
            marks.append(Mark(at, f"a pipeline stage without {lacks} (pre_process={pre}, post_process={post})",
                              MEGATRON_STAGES, "pipeline"))
        for what, renumbered in _stage_share(module):
            marks.append(Mark(at, what, RENUMBERED_STAGE if renumbered else CUT_STAGE, "pipeline"))
        for name, p in module.named_parameters(recurse=False):
            mark = _parameter_mark(canonical_name(f"{path}.{name}" if path else name), p)
            if mark is not None:
                marks.append(mark)
    return marks


def _stage_share(module: torch.nn.Module) -> list[tuple[str, bool]]:
    """What says that ``module`` is a pipeline stage's share of a model, each with whether its layers lost their
    numbers. The embedding, the final norm or the head emptied (torchtitan's split); fewer layers than its
    config numbers (a stage cut from a transformers model: renumbered from 0); or a ``ModuleDict`` of layers
    numbered from above 0 (torchtitan's keep their numbers)."""
    found: list[tuple[str, bool]] = []
    emptied = [name for name, child in module._modules.items() if child is None and name in _ENDS]
    if emptied:
        # Assigning None to a registered submodule keeps its slot: the model was built with it.
        found.append((f"{', '.join(emptied)} set to None after the model was built", False))
    layers = getattr(module, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        want = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if isinstance(want, int) and len(layers) < want:
            found.append((f"{len(layers)} of the {want} layers its config numbers, renumbered from 0", True))
    elif isinstance(layers, torch.nn.ModuleDict) and all(k.isdigit() for k in layers.keys()):
        keys = sorted(int(k) for k in layers.keys())
        if keys and keys != list(range(len(keys))):
            found.append((f"layers {keys[0]}-{keys[-1]} of a numbering that does not start at 0", False))
    return found


def _parameter_mark(where: str, p: torch.Tensor) -> Mark | None:
    if getattr(p, "tensor_model_parallel", False) is True:
        return Mark(where, f"tensor_model_parallel=True, partition_dim={getattr(p, 'partition_dim', '?')}: this "
                    "rank's slice in a plain tensor", MEGATRON_LAYERS, "megatron")
    if getattr(p, "allreduce", True) is False:
        return Mark(where, "allreduce=False: an expert only some ranks hold", "DeepSpeed MoE or Megatron-Core's "
                    "expert layers", "experts")
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    foreign = [n for n in names if n in _FOREIGN_DIMS]
    if foreign:
        pipeline = foreign[0] == "pp"
        return Mark(where, f"a DTensor on a mesh dimension named {foreign[0]!r} ({_FOREIGN_DIMS[foreign[0]]})",
                    "a device mesh with that dimension" if pipeline else EXPERT_MESH,
                    "pipeline" if pipeline else "experts")
    return None


def refuse_foreign(model: torch.nn.Module, backend: str, reads: tuple[str, ...] = ()) -> None:
    """``UnsupportedModelError`` naming the first marks and every fix, where ``model`` carries any but those
    of the producers the adapter ``reads``."""
    marks = [m for m in foreign_marks(model) if m.producer not in reads]
    if not marks:
        return
    by_producer: dict[str, list[Mark]] = {}
    for m in marks:
        by_producer.setdefault(m.producer, []).append(m)
    # The first mark of each producer, and how many more it left.
    shown = "; ".join(f"{ms[0].where}: {ms[0].what}, from {producer}" + (f" (and {len(ms) - 1} more)" if ms[1:] else "")
                      for producer, ms in by_producer.items())
    fixes = "; or ".join(dict.fromkeys(_FIXES[m.kind] for m in marks))
    raise UnsupportedModelError(
        f"this model was partitioned by another framework in a way wrapkit cannot read yet: {shown}. Read as "
        f"a {backend} model, each rank's part would pass for the whole model and every export would miss the "
        f"rest; {fixes}."
    )
