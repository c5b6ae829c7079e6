"""State dicts: ``full_state_dict`` and ``load_full_state_dict`` on every backend.

Names are canonical (:func:`canonical_name`): the keys of ``wm.unwrap().state_dict()``,
whatever wraps the model. A full state dict holds every parameter *and every persistent
buffer* (exactly the keys ``state_dict()`` of the unwrapped model has; non-persistent
buffers such as rotary caches are left out, as ``state_dict()`` leaves them out), as CPU
tensors. Parameters are read through the ``gather_each`` primitive (one gathered at a
time) and written inside ``gathered(wm, modifier_rank=0)``, so the backends' own gather
and write-back are used; buffers are never sharded by any backend and are read and
written where they are. Every problem is agreed on across the group before anything is
written (``_agree``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._agree import Call, enter, raise_agreed, writes_files
from .._errors import UnsupportedModelError, WrapkitError
from .._names import canonical_name
from .._results import LoadResult
from ..adapters import Written
from ..adapters.stages.parts import stage_buffers
from ..adapters.stages.plan import buffer_shapes, every_stage, state_hooks, state_keys
from ..base.module_internals import assign, assign_named, live_entries
from ..layers.lora_fold import LoraFoldPlan, fold_plan, fold_state_dict
from ..sync.gathering import gathered

if TYPE_CHECKING:
    from ..adapters.core.base import Adapter

__all__ = ["full_state_dict", "gather_state_dict", "load_full_state_dict", "expected_shapes", "check_entries",
           "write", "assign", "Shape", "lora_fold_plan", "joined_fold_plan", "report_skipped"]

Shape = tuple[int, ...]

_log = logging.getLogger(__name__.rpartition(".")[0] or __name__)


# -- names, shapes and live tensors ----------------------------------------------------
def expected_shapes(wm: Adapter) -> dict[str, Shape]:
    """Canonical name -> full shape of every state-dict entry, read without gathering anything."""
    out = wm.weights.param_shapes()
    out.update(buffer_shapes(wm))
    return out


def _shapes_of(sd: Mapping[str, Any]) -> dict[str, Shape | None]:
    """Shape of each entry; ``None`` for a value that is not a tensor."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def check_entries(given: Mapping[str, Shape | None], expected: Mapping[str, Shape], strict: bool,
           names: tuple[str, str] = ("the state dict", "the model")) -> list[str]:
    """Every missing, unexpected, mis-shaped or non-tensor entry of ``given``, one line each."""
    ours, theirs = names
    problems: list[str] = []
    if strict:
        problems += [f"missing key {k!r}: in {theirs} (shape {list(v)}), not in {ours}"
                     for k, v in expected.items() if k not in given]
        problems += [f"unexpected key {k!r}: in {ours}, not in {theirs}" for k in given if k not in expected]
    for key, shape in given.items():
        if key not in expected:
            continue
        if shape is None:
            problems.append(f"{key!r} in {ours} is not a tensor")
        elif shape != expected[key]:
            problems.append(f"{key!r} has shape {list(shape)} in {ours}, {list(expected[key])} in {theirs}")
    return _likely_cause(given, expected, strict, names) + problems if problems else problems


def _likely_cause(given: Mapping[str, Shape | None], expected: Mapping[str, Shape], strict: bool,
                  names: tuple[str, str]) -> list[str]:
    """One line ahead of a long list, naming the usual reason for it where the keys show one."""
    ours, theirs = names
    unexpected = [k for k in given if k not in expected]
    prefixed = [k for k in unexpected if canonical_name(k) != k and canonical_name(k) in expected]
    if strict and prefixed and len(prefixed) * 2 >= len(unexpected):
        return [f"{len(prefixed)} of the {len(unexpected)} unexpected keys in {ours} are the model's own keys "
                f"behind a wrapper's prefix (e.g. {prefixed[0]!r}): it was taken from a wrapper's state_dict(); "
                "strip the prefixes with wrapkit.canonical_name, or save with wm.full_state_dict() / wm.save()"]
    shared = [k for k in given if k in expected and given[k] is not None]
    wrong = [k for k in shared if given[k] != expected[k]]
    if len(wrong) >= 2 and len(wrong) == len(shared):
        return [f"all {len(wrong)} keys that {ours} and {theirs} share differ in shape: is it a checkpoint of "
                "another model size?"]
    return []


# -- reading ---------------------------------------------------------------------------
def full_state_dict(wm: Adapter, rank0_only: bool = True, *, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer under its canonical name, as CPU tensors.

    Every rank must call it (sharded backends gather); with ``rank0_only`` the other
    ranks get ``{}``. ``merge_adapters=True`` on a PEFT model returns the base model's
    weights with the LoRA adapters folded in, under the base model's names; the live
    model is not changed.
    """
    enter(Call.of("full_state_dict", rank0_only=rank0_only, merge_adapters=merge_adapters), wm)
    return gather_state_dict(wm, rank0_only, merge_adapters)


def gather_state_dict(wm: Adapter, rank0_only: bool, merge_adapters: bool = False) -> dict[str, torch.Tensor]:
    """The body of ``full_state_dict``, shared with ``save`` (which enters as itself)."""
    if merge_adapters:
        # Validate before any gather: an unsupported PEFT layer must fail on every rank alike.
        refused = None
        try:
            plan = lora_fold_plan(wm)
        except WrapkitError as exc:
            plan, refused = None, exc
        plan = joined_fold_plan(wm, plan, refused)
    keep = not rank0_only or wm.rank == 0
    out: dict[str, torch.Tensor] = {}
    # Tied parameters come once per name; they stay one tensor, as in state_dict().
    owner = {name: id(p) for name, p in wm.named_live(buffers=False)}
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, full in wm.gatherer.each():
            if not keep:
                continue
            key = owner.get(name)
            if key is not None and key in copies:
                out[name] = copies[key]
                continue
            # A fresh CPU copy: the gathered buffer is reused or freed after this step.
            out[name] = full.detach().to("cpu", copy=True).contiguous()
            if key is not None:
                copies[key] = out[name]
        # Every rank walks the buffers: a pipeline stage's come from the stages that hold them.
        for name, b in stage_buffers(wm):
            if keep:
                out[name] = b.detach().to("cpu", copy=True).contiguous()
    if not keep:
        return out
    # Key order of the unwrapped model's own state_dict(): per module, its parameters then its buffers
    # (the whole model's, where a pipeline stage holds some of its modules).
    order = dict.fromkeys(state_keys(wm))
    out = {k: out[k] for k in order if k in out} | {k: v for k, v in out.items() if k not in order}
    merged = False
    if merge_adapters and plan is not None:
        out, merged = fold_state_dict(out, plan), True
    hooks = state_hooks(wm, merged)  # the module's own state dict: its hooks' names and tensors
    return out if hooks is None else dict(hooks.export(out.items()))


# -- PEFT merge (the folding itself is layers/peft.py's) ------------------------------------------
def lora_fold_plan(wm: Adapter) -> LoraFoldPlan | None:
    """What merging ``wm``'s LoRA adapters on this rank needs (None without PEFT); ``UnsupportedModelError``
    for layers that cannot be merged, alike on every rank that holds the same layers. Nothing collective:
    a pipeline stage's is its own layers' (``joined_fold_plan``)."""
    peft_root = wm.merge_root()
    return None if peft_root is None else fold_plan(peft_root)


def joined_fold_plan(wm: Adapter, plan: LoraFoldPlan | None, refused: WrapkitError | None) -> LoraFoldPlan | None:
    """After the operation's entry: ``plan`` (this rank's ``lora_fold_plan``), or ``refused`` raised. On pipeline
    stages, which each hold their own LoRA layers, every stage's plan joined, and a refusal on any stage
    raised on all of them (a collective over the stages)."""
    every = every_stage(wm, (None if refused is None else str(refused), plan))
    if every is None:
        if refused is not None:
            raise refused
        return plan
    refusals = [why for why, _ in every if why is not None]
    if refusals:
        raise UnsupportedModelError(refusals[0])
    plans = [p for _, p in every if p is not None]
    return LoraFoldPlan.join(plans) if plans else None


# -- writing ---------------------------------------------------------------------------
def _write_into(root: torch.nn.Module, values: Iterable[tuple[str, torch.Tensor]], alpha: float) -> None:
    assign_named(dict(live_entries(root)), values, alpha)


def write(target: Adapter, values: Iterable[tuple[str, torch.Tensor]], alpha: float) -> None:
    """Write ``values`` (canonical name -> full tensor) into ``target``'s parameters and buffers."""
    own = getattr(target.weights, "write_values", None)
    if own is not None:
        # A backend that keeps each rank's slices in plain tensors (Megatron-Core's) writes them from the full
        # values every rank has, with no collective: gathering would run its parallel layers on full weights.
        own(values, alpha)
        return
    topology = target.topology()
    if not target.distributed or (topology.stage() is not None and not topology.pp_outside()):
        # Its parameters are full and local to this process, which may be the only one
        # calling (rank 0 loading a plain copy): no collective may be entered. A pipeline
        # stage's are too: each stage writes its own layers from the values every rank has.
        _write_into(target.unwrap(), values, alpha)
        target.weights.written(Written.WEIGHTS)
        return
    # modifier_rank=0: every rank writes the same values and rank 0's reach every shard,
    # replica and optimizer master copy on exit (gathered() refreshes those itself). A stage
    # inside another backend gathers its own layers within the stage, and writes them.
    with gathered(target, modifier_rank=0, own_stage=True) as root:
        _write_into(root, values, alpha)


def load_full_state_dict(wm: Adapter, sd: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
    """Load a full (unsharded, canonically named) state dict into ``wm`` on any backend.

    Every rank must call it with the same ``sd``. Missing, unexpected (when ``strict``)
    and mis-shaped keys raise one ``StateDictError`` listing all of them before anything
    is written.
    """
    problems: list[str] = []
    expected = expected_shapes(wm)
    if not isinstance(sd, Mapping):
        problems.append(f"expected a mapping of name -> tensor, got {type(sd).__name__}")
    if not problems:
        hooks = state_hooks(wm)  # in the module's own state-dict names: its load hooks make its tensors
        if hooks is not None:
            try:
                sd = hooks.to_runtime(sd)
            except Exception as exc:  # a hook that refuses these tensors, reported on every rank
                problems.append(f"the model's own load_state_dict hooks refused the state dict: {exc}")
    if not problems:
        problems = check_entries(_shapes_of(sd), expected, strict)
    [agreed] = enter(Call.of("load_full_state_dict", strict=strict), wm, flags=[bool(problems)], invalid=1)
    raise_agreed(problems, f"load_full_state_dict into {' > '.join(wm.stack)}",
                  "Pass a full state dict of this architecture (the keys of wm.full_state_dict()), the same on "
                  "every rank; strict=False skips missing and unexpected keys, never a wrong shape.", wm, agreed=agreed)
    write(wm, sd.items(), 1.0)
    wm.weights.written(Written.VALUES, sd)
    return report_skipped(wm, LoadResult.of(sd, expected), "load_full_state_dict", "the state dict")


def report_skipped(wm: Adapter, result: LoadResult, op: str, source: str) -> LoadResult:
    """``result``, logged as a warning (once per model, by the rank that writes its files) when a
    lenient load left something out: a silent partial load looks like a complete one."""
    missing, unexpected = result
    if (missing or unexpected) and writes_files(wm):
        def some(keys: list[str]) -> str:
            return ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")

        _log.warning("%s(strict=False) left out %d key(s) of the model that %s lacks (they keep their values: %s) "
                     "and %d of its key(s) the model has no place for (not read: %s)", op, len(missing), source,
                     some(missing) or "none", len(unexpected), some(unexpected) or "none")
    return result


