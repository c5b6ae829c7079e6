"""The whole model of a pipeline, on every rank: ``gathered()`` and ``generation(gather="full")`` on stages; and
the transformers model a backend's own layout names (``whole_in_hub_layout``: Megatron-Core's).

No stage has the other stages' layers, not even as empty shells (transformers keeps identity placeholders,
torchtitan deletes them), so the whole model is built anew from the config, the way ``from_pretrained``
builds one, and filled from every stage's tensors as an export walks them (``StageGatherer.each``). It is a
separate module: a change made in it reaches the stages only when a ``modifier_rank`` is given, whose whole
model every stage then copies its own layers from.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._agree import settle
from ..._names import canonical_name, model_class_name
from ...base.module_internals import init_weights, live_entries, own_buffers
from ...formats.hub import HubLayout
from ..core.likeness import copy_buffers, skip_init
from ..core.parts import Written
from .parts import stage_buffers

if TYPE_CHECKING:
    from ..core.base import Adapter

__all__ = ["whole_problem", "whole_of_stages", "whole_in_hub_layout"]


def whole_problem(model: Adapter, modifier_rank: int | None) -> str | None:
    """Why the whole model of ``model``'s stages cannot be built here (None: it can). Known alike on every
    rank: the model's structure and the call's arguments."""
    inner = model.unwrap(keep_peft=False)
    if model.merge_root() is not None:
        return ("the stages carry LoRA layers, and only this stage's are known here: the whole model would lack "
                "the others'")
    if getattr(inner, "config", None) is None:
        return (f"{model_class_name(inner)} has no config to build the whole model from (a model cut by hand "
                "keeps no record of the layers it lost)")
    if modifier_rank is not None and model.topology().pp_outside():
        return ("writing the whole model back (modifier_rank) is not supported on stages inside another backend; "
                "gather without modifier_rank, and load the changed values with load_full_state_dict()")
    return None


@contextlib.contextmanager
def whole_of_stages(model: Adapter, modifier_rank: int | None) -> Iterator[torch.nn.Module]:
    """The whole model, on every rank, with every stage's values; on exit with ``modifier_rank``, each stage
    takes its own layers' values from that rank's whole model. Collective over all the stages."""
    whole = _built(model)
    params = {canonical_name(n): p for n, p in whole.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        # Cloned: an owner's export yields its live tensor, which the whole model must not share.
        for name, value in model.gatherer.each():
            params[name].data = value.detach().to(model.device, copy=True)
        copy_buffers(model.unwrap(keep_peft=False), whole)  # non-persistent ones (rotary tables): in no export
        homes = _buffer_homes(whole)
        for name, value in stage_buffers(model):
            module, key = homes[name]
            module._buffers[key] = value.detach().to(model.device, copy=True)

    def finish(failed: bool) -> None:
        if modifier_rank is not None and not failed:
            _write_back(model, whole, modifier_rank)

    with settle(finish, modifier_rank is not None, model.process_group(), model.world_size):
        yield whole


def _built(model: Adapter) -> torch.nn.Module:
    """The model's class built from its config, without initialising weights that are overwritten next."""
    inner = model.unwrap(keep_peft=False)
    config: Any = copy.deepcopy(getattr(inner, "config", None))
    if getattr(config, "distributed_config", None) is not None:
        config.distributed_config = None  # the whole model, not a stage of it again
    skip: Any = skip_init() or contextlib.nullcontext
    with torch.device(model.device), skip():
        whole = type(inner)(config)
    _tie(whole)
    generation_config = getattr(inner, "generation_config", None)
    if generation_config is not None:
        whole.generation_config = copy.deepcopy(generation_config)
    whole.train(inner.training)
    return whole


def _buffer_homes(root: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    homes: dict[str, tuple[torch.nn.Module, str]] = {}
    for path, module in root.named_modules():
        for key in module._buffers:
            homes[canonical_name(f"{path}.{key}" if path else key)] = (module, key)
    return homes


def _write_back(model: Adapter, whole: torch.nn.Module, modifier_rank: int) -> None:
    """Every tensor of ``modifier_rank``'s whole model, broadcast over the stages; each stage copies its own."""
    live = dict(live_entries(model.unwrap()))
    with torch.no_grad():
        for name, sent in _broadcast_whole(model, whole, modifier_rank):
            mine = live.get(name)
            if mine is not None:
                mine.copy_(sent)
    model.weights.written(Written.WEIGHTS)


def _broadcast_whole(model: Adapter, whole: torch.nn.Module, modifier_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``modifier_rank``'s whole model, every tensor broadcast over the model's group."""
    group = model.process_group()
    src = dist.get_global_rank(group, modifier_rank)
    comm = torch.device("cpu") if dist.get_backend(group) == "gloo" else model.device
    for name, value in live_entries(whole):
        sent = value.detach().to(comm, copy=True).contiguous()
        dist.broadcast(sent, src=src, group=group)
        yield name, sent


def _tie(whole: torch.nn.Module) -> None:
    """A tied head made one tensor with the embedding, which filling the embedding then fills."""
    tie = getattr(whole, "tie_weights", None)
    if callable(tie):
        tie()


@contextlib.contextmanager
def whole_in_hub_layout(model: Adapter, layout: Any, modifier_rank: int | None) -> Iterator[torch.nn.Module]:
    """The transformers model of ``layout`` (``hub_config()``), on every rank, filled with the model's values in
    the Hub's layout: a model whose own layers cannot run on full weights (Megatron's parallel layers run their
    collectives whatever they hold) generates in it. On exit with ``modifier_rank``, every rank takes its slices
    from that rank's model. Collective over all the ranks holding the model."""
    import transformers

    config = layout.hub_config()
    skip: Any = skip_init() or contextlib.nullcontext
    with torch.device(model.device), skip():
        whole: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    _tie(whole)
    params = {canonical_name(n): p for n, p in whole.named_parameters(remove_duplicate=False)}
    # The Hub's tensors may not be the transformers model's own (Qwen3-MoE fuses its experts at run time): its
    # own Hub layout turns them into its tensors.
    own = HubLayout.of(whole)
    importer = own.importer({n: tuple(p.shape) for n, p in params.items()}) if own is not None else None
    with torch.no_grad():
        for key, tensor in layout.export(model.gatherer.each()):
            for name, value in importer.feed(key, tensor) if importer is not None else [(key, tensor)]:
                params[name].data = value.detach().to(model.device, copy=True)
        # Non-persistent buffers (rotary tables) were skipped with the weights, and no export holds them: built
        # from the config as transformers builds them.
        init: Any = init_weights(whole)
        for module in whole.modules():
            if init is not None and any(True for _ in own_buffers(module, persistent=False)):
                init(module)
    whole.train(model.unwrap().training)

    def finish(failed: bool) -> None:
        if modifier_rank is not None and not failed:
            _write_back_hub(model, layout, whole, modifier_rank)

    with settle(finish, modifier_rank is not None, model.process_group(), model.world_size):
        yield whole


def _write_back_hub(model: Adapter, layout: Any, whole: torch.nn.Module, modifier_rank: int) -> None:
    """``modifier_rank``'s model broadcast over the model's group, turned back into the backend's tensors."""
    entries = _broadcast_whole(model, whole, modifier_rank)
    own = HubLayout.of(whole)
    hub = dict(own.export(entries) if own is not None else entries)
    runtime = [name for name, _ in model.named_live(buffers=False)]
    values = ((name, layout.build(name, hub.__getitem__)) for name in runtime
              if (keys := layout.sources(name)) is not None and all(k in hub for k in keys))
    model.weights.write_values(values, 1.0)  # type: ignore[attr-defined]
