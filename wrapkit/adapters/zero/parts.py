"""The parts of a model in a DeepSpeed engine. Below ZeRO-3 every rank holds each weight whole (the
whole-tensor parts, with the optimizer's fp32 masters); at ZeRO-3 each parameter is an empty placeholder
whose full size is recorded in ``ds_numel`` / ``ds_shape`` and whose rank's slice is ``ds_tensor``
(``zero/partitions.py`` reads and writes them).

A 16-bit engine's optimizer steps fp32 masters of the weights: exports read them, loads write them
exactly, and a write into the weights refreshes them (``Written``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..._agree import settle
from ..._gather import Bypass, submodules, walk_tensors
from ..._imports import require
from ..._names import canonical_name
from ..core.parts import Parts, Written, flat_view
from ..core.primitives import Piece
from ..core.whole import WholeGatherer, WholePlacement, WholeWeights, move_buffers
from .partitions import each_full, full_writer, partition_writer, settle_gathers

if TYPE_CHECKING:
    from ..core.base import Adapter
    from ..core.primitives import AdapterView

__all__ = ["zero_parts"]

Master = Callable[[Any], torch.Tensor | None]


def zero_parts(model: Adapter) -> Parts:
    return Parts(ZeroWeights(model), ZeroGatherer(model), ZeroPlacement(model))


def masters(engine: Any) -> Master | None:
    """The fp32 master copy the optimizer keeps of a 16-bit parameter (bf16/fp16 engines), as a full
    tensor; None where the engine keeps no masters (fp32, or no optimizer)."""
    half = any(callable(getattr(engine, f, None)) and getattr(engine, f)()
               for f in ("bfloat16_enabled", "fp16_enabled"))
    optimizer = getattr(engine, "optimizer", None)
    if not half or optimizer is None:
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    # ZeRO-0's unfused optimizer keeps one fp32 parameter per 16-bit one, group by group;
    # ZeRO 1-3 and the bf16 optimizer link each parameter to its fp32 fragment themselves.
    groups = zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ()), strict=False)
    unfused: dict[int, torch.Tensor] = {id(low): high for lows, highs in groups
                                        for low, high in zip(lows, highs, strict=False)}

    def master(p: Any) -> torch.Tensor | None:
        if id(p) in unfused:
            return unfused[id(p)]
        found: torch.Tensor | None = safe_get_full_fp32_param(p)  # collective under ZeRO 1-3
        return found
    return master


def _first(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def values(t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1)[:n]
    return values


def _partition(p: torch.Tensor) -> torch.Tensor:
    """This rank's partition of a ZeRO-3 parameter (the parameter itself elsewhere)."""
    part: torch.Tensor = getattr(p, "ds_tensor", p)
    return part


def _stage3(model: AdapterView) -> bool:
    return model.zero_stage == 3


class ZeroWeights(WholeWeights):
    def global_numel(self, p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {id(p): tuple(p.ds_shape) for p in self.model._innermost.parameters() if hasattr(p, "ds_shape")}

    def resident_bytes(self) -> int:
        if not _stage3(self.model):
            return super().resident_bytes()
        total = 0
        for p in self.model._unique_parameters():
            part = getattr(p, "ds_tensor", None)
            if part is not None:
                total += part.numel() * part.element_size()
            total += p.numel() * p.element_size()  # non-zero only while the parameter is gathered
        return total

    def local_shards(self) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]] | None:
        if not _stage3(self.model):
            return None
        ranks = tuple(dist.get_process_group_ranks(self.model.process_group() or dist.group.WORLD))
        out: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {}
        for name, p in self.model.unwrap().named_parameters():
            part = getattr(p, "ds_tensor", None)
            if part is None:
                return None
            # ZeRO-3 splits the flattened, padded parameter evenly over the group's ranks.
            out[canonical_name(name)] = (part, ("zero3", ranks, tuple(getattr(p, "ds_shape", ())), part.numel()))
        return out

    def layout_tensors(self) -> list[torch.Tensor] | None:
        if not _stage3(self.model):
            return None
        # Straight from each module's dicts: ``parameters()`` and ``buffers()`` cost several times more.
        return walk_tensors(self.model.unwrap(), _partition)

    def pieces(self) -> list[Piece]:
        # ZeRO-3: each rank's partition is a contiguous range of the flattened, padded parameter.
        # A 16-bit engine's optimizer also gets the exact values in its fp32 masters.
        master = masters(self.model.backend_object)
        out: list[Piece] = []
        for name, p in self.model.unwrap().named_parameters():
            keep = master if (master is not None and p.requires_grad) else None
            part = getattr(p, "ds_tensor", None)
            # The read side only where these are the values the optimizer steps, or where nothing steps them (a
            # frozen parameter); an engine's fp32 masters are read through the Resume part.
            read = keep is None
            if part is None:
                out.append(Piece(canonical_name(name), 0, p.numel(), tuple(p.shape), full_writer(p, keep),
                                 source=p if read else None, values=flat_view if read else None,
                                 live=functools.partial(flat_view, p)))
                continue
            size = part.numel()
            start = dist.get_rank(p.ds_process_group) * size  # type: ignore[attr-defined]
            valid = max(0, min(size, int(p.ds_numel) - start))  # type: ignore[attr-defined]
            if valid:
                shape = tuple(p.ds_shape)  # type: ignore[attr-defined]
                out.append(Piece(canonical_name(name), start, valid, shape, partition_writer(p, part, valid, keep),
                                 source=part if read else None, values=_first(valid) if read else None,
                                 live=functools.partial(_first(valid), part)))
        return out

    def written(self, kind: Written, values: Mapping[str, torch.Tensor] | None = None) -> None:
        if kind is Written.WEIGHTS:
            self._refresh_masters()
        elif kind is Written.SHARDS:
            self._refresh_full_copies()
        elif kind is Written.PIECES:
            if masters(self.model.backend_object) is None:
                self._refresh_masters()  # fp32 engines: the optimizer's copies come from the weights
            self._refresh_full_copies()
        elif kind is Written.VALUES and values is not None:
            self._exact_masters(values)

    def _refresh_masters(self) -> None:
        # ZeRO 1-3 (and the bf16/fp16 optimizers) step an fp32 master copy of each
        # partition, cloned at initialize time even for fp32 models: without a refresh
        # the next step would overwrite whatever was loaded into the module's weights.
        refresh = getattr(getattr(self.model.backend_object, "optimizer", None), "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    def _exact_masters(self, values: Mapping[str, torch.Tensor]) -> None:
        # After a load the 16-bit weights hold the loaded values rounded; the masters get them exact.
        master = masters(self.model.backend_object)
        if master is None:
            return
        from deepspeed.utils import safe_set_full_fp32_param

        device = self.model.device
        with torch.no_grad():
            for name, p in self.model.unwrap().named_parameters():
                value = values.get(canonical_name(name))
                if value is None or not p.requires_grad:
                    continue
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # ZeRO 1-3, bf16 optimizer: fragments
                    safe_set_full_fp32_param(p, value.to(device=device, dtype=torch.float32))
                elif (own := master(p)) is not None:  # ZeRO-0's unfused optimizer: the fp32 parameter itself
                    own.copy_(value.reshape(own.shape))

    def _refresh_full_copies(self) -> None:
        # ZeRO-3 keeps small ("persistent") parameters gathered between forwards once it has
        # traced the model; their full copies were built before the partitions changed.
        # (DeepSpeed: mark_persistent_parameters in deepspeed/runtime/zero/parameter_offload.py,
        # sized by stage3_param_persistence_threshold.) The full copies get the partitions' new
        # values in place (the same set on every rank). Releasing and gathering them again would go
        # through DeepSpeed's parameter state machine, which, before 0.19, refuses to release a
        # parameter that a forward without its backward yet still holds (ds_active_sub_modules).
        if not _stage3(self.model):
            return
        stale: list[Any] = list({
            id(p): p for m in submodules(self.model.unwrap()) for p in m._parameters.values()
            if getattr(getattr(p, "ds_status", None), "name", "") == "AVAILABLE"
        }.values())
        with torch.no_grad():
            for p, full in ZeroGatherer(self.model).from_partitions(stale):
                p.data.copy_(full.view(p.data.shape))


class ZeroGatherer(WholeGatherer):
    def one(self, p: torch.Tensor) -> torch.Tensor:
        return self._full(p, masters(self.model.backend_object))

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        master = masters(self.model.backend_object)  # looked up once, not once per parameter
        for name, p in self.model.unwrap().named_parameters(remove_duplicate=False):
            yield canonical_name(name), self._full(p, master)

    def _full(self, p: torch.Tensor, master: Master | None) -> torch.Tensor:
        # Exported weights are the ones the optimizer steps: the fp32 masters, where it keeps them.
        full = master(p) if master is not None and p.requires_grad else None
        if full is None:
            return self._gather_16bit(p)
        return full.detach().view(tuple(getattr(p, "ds_shape", p.shape))).to(self.model.device)

    def exported(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        # A checkpoint holds what the optimizer steps: the fp32 masters of the trained parameters, one
        # parameter at a time (each a collective under ZeRO 1-3); the module's weights where there are none.
        master = masters(self.model.backend_object)
        if master is None:
            yield from self.many(params)
            return
        for p in params:
            yield p, self._full(p, master)

    # ZeRO-3 partitions every parameter on its own, and any set of them goes in one all-gather (``many``):
    # each parameter is a unit, as for whole tensors. The engine's parameters are in its compute dtype
    # (16-bit under bf16/fp16; the fp32 masters live in the optimizer), so their own element size is
    # what a gather moves (``full_bytes``). ZeRO-3's own forward hooks gather each submodule's
    # partitions before it runs and release them after (``layerwise``): nothing to set up.

    def bypass(self) -> Bypass | None:
        # ZeRO-3 puts fetch/release hooks on every submodule (deepspeed.runtime.zero); below stage 3
        # the parameters are whole and the engine adds nothing to the module's own forward.
        return Bypass(("deepspeed.",)) if _stage3(self.model) else None

    def _gather_16bit(self, p: torch.Tensor) -> torch.Tensor:
        shard = getattr(p, "ds_tensor", None)
        if shard is None:
            return p.detach()
        # All-gather straight from the partitions into one fresh buffer: the extra
        # memory is that buffer only, and ZeRO-3's own parameter state is untouched.
        group = p.ds_process_group  # type: ignore[attr-defined]
        world = dist.get_world_size(group)
        part = shard.detach().reshape(-1).to(self.model.device)
        out = torch.empty(world * part.numel(), dtype=part.dtype, device=part.device)
        dist.all_gather(list(out.chunk(world)), part, group=group)
        return out[: int(p.ds_numel)].view(p.ds_shape)  # type: ignore[attr-defined]

    def from_partitions(self, params: list[Any]) -> Iterator[tuple[Any, torch.Tensor]]:
        """Full values of ``params`` read from their partitions alone: one all-gather where they
        share a group and a dtype and their partitions are in memory, else one each."""
        if self._partitions_together(params):
            yield from each_full(params)
            return
        for p in params:
            yield p, self._gather_16bit(p)

    def _one_gather(self, todo: list[Any]) -> list[Any] | None:
        """``todo`` when one all-gather of their partitions serves them: every partition in memory
        on the compute device, in one dtype and one group; None otherwise (NVMe or CPU offload,
        parameters mid-gather), for ``GatheredParameters`` or one gather each to serve."""
        if any(getattr(p.ds_status, "name", "") != "NOT_AVAILABLE" for p in todo):
            return None
        return todo if self._partitions_together(todo) else None

    def _partitions_together(self, params: list[Any]) -> bool:
        """Whether one all-gather of their partitions (``each_full``) serves ``params``: every
        partition in memory on the compute device, in one dtype and one group."""
        if not params:
            return True
        group, dtype = params[0].ds_process_group, params[0].ds_tensor.dtype
        device = self.model.device
        for p in params:
            part = p.ds_tensor
            if (getattr(part, "status", None) is None or part.status.name != "AVAILABLE"
                    or p.ds_process_group is not group or part.dtype != dtype
                    or part.device.type != device.type or part.numel() != part.ds_numel):
                return False
        return True

    def many(self, params: list[torch.nn.Parameter]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        # The module's own weights (16-bit in a bf16 engine), not the optimizer's masters: what a
        # forward computes with, and what an inference engine is fed.
        if not _stage3(self.model):
            yield from super().many(params)
            return
        rest = [p for p in params
                if hasattr(p, "ds_tensor") and getattr(getattr(p, "ds_status", None), "name", "") != "AVAILABLE"]
        todo = self._one_gather(rest)
        # The values come in the order of ``params``, whichever are gathered already (ZeRO-3's persistent
        # parameters, which become so after their first use): a stream's order must not change between calls.
        gathered = iter(list(each_full(todo)) if todo is not None else ((p, self._gather_16bit(p)) for p in rest))
        waiting = {id(p) for p in rest}
        for p in params:
            yield next(gathered) if id(p) in waiting else (p, p.detach())

    @contextlib.contextmanager
    def full(self, modifier_rank: int | None) -> Iterator[Any]:
        if not _stage3(self.model):
            with super().full(modifier_rank) as replace:
                yield replace
            return
        deepspeed = require("deepspeed", feature="gathered() under ZeRO-3")
        params: list[Any] = [p for p in self.model._unique_parameters() if hasattr(p, "ds_id")]
        if modifier_rank is None:
            # Reading: full copies from one all-gather, swapped in by ``bypassed``; ZeRO-3's own
            # parameter state is never touched, so there is nothing to re-partition on exit.
            # Parameters already gathered (the persistent ones) are used as they are.
            todo = self._one_gather([p for p in params if getattr(p.ds_status, "name", "") != "AVAILABLE"])
            if todo is not None:
                fast = {id(p): torch.nn.Parameter(full, requires_grad=p.requires_grad) for p, full in each_full(todo)}
                yield lambda mod, name, p: fast.get(id(p))
                return
        # Small "persistent" parameters stay gathered between steps; GatheredParameters
        # re-partitions them on exit, so they are gathered again afterwards (see
        # mark_persistent_parameters in deepspeed/runtime/zero/parameter_offload.py).
        persistent = [p for p in params if getattr(p.ds_status, "name", "") == "AVAILABLE"]
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
        ctx.__enter__()
        settle_gathers(params)  # before anything reads or writes the gathered values

        def finish(failed: bool) -> None:
            try:
                if failed and ctx.enabled:
                    # Re-partition without the broadcast: the shards were never written.
                    ctx.src_rank = None
                    ctx._param_versions = None
            finally:
                ctx.__exit__(None, None, None)
                if persistent:
                    persistent[0].all_gather(param_list=persistent)
                    settle_gathers(persistent)
            if modifier_rank is not None and not failed:
                model.weights.written(Written.WEIGHTS)

        model = self.model
        with settle(finish, modifier_rank is not None, model.process_group(), model.world_size,
                    model.replica_groups()):
            yield None


class ZeroPlacement(WholePlacement):
    def move(self, target: torch.device, copy: bool) -> None:
        model = self.model
        engine: Any = model.backend_object
        stage = model.zero_stage or 0
        optimizer: Any = getattr(engine, "optimizer", None)
        if stage == 3 and hasattr(optimizer, "empty_partition_cache"):
            # Gathered (persistent) parameters are released first: only partitions then hold data.
            optimizer.empty_partition_cache()
        if stage > 0 and hasattr(optimizer, "offload_states") and hasattr(optimizer, "lp_param_buffer" if stage == 3
                                                                          else "bit16_groups_flat"):
            # ZeRO-1/2/3 with an optimizer: the partitions are views into flat buffers that the
            # optimizer writes after each step; DeepSpeed's own offload keeps those views intact.
            from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

            offloaded = OffloadStateTypeEnum.lp_params in getattr(optimizer, "offloaded_states", ())
            if target == model.device:
                if offloaded:
                    engine.reload_states()
            elif target.type == "cpu":
                if not offloaded:
                    engine.offload_states(include=[OffloadStateTypeEnum.lp_params], device=OffloadDeviceEnum.cpu,
                                          pin_memory=False)
            else:
                raise ValueError(f"a ZeRO-{stage} engine moves its parameters between {model.device} and cpu only, "
                                 f"not to {target}")
        elif stage == 3:
            # No optimizer (an inference engine): each parameter owns its partition.
            for p in engine.module.parameters():
                p.ds_tensor.data = p.ds_tensor.data.to(target, copy=copy)
        else:
            engine.module._apply(lambda t: t.to(target, copy=copy))
            return
        move_buffers(engine.module, target, copy)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not _stage3(self.model):
            yield from super().tensors()
            return
        module: Any = self.model.backend_object
        for name, p in module.module.named_parameters():
            yield f"{canonical_name(name)} (partition)", p.ds_tensor
            if p.numel() > 0:  # gathered right now
                yield canonical_name(name), p
        for name, buf in module.module.named_buffers():
            yield canonical_name(name), buf
