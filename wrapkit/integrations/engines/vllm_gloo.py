"""A gloo weight-transfer backend for vLLM's own server, registered as a vLLM plugin.

vLLM's transfer backends all need CUDA (NCCL, IPC, ...). This one is vLLM's dense NCCL engine with the data plane
replaced by a torch gloo group: the same init info, the same routes and session rules, the same packed wire (tensors
back to back in the metadata's order, a chunk closed right after the tensor that takes it past the buffer size),
each chunk handed to the model's ``load_weights`` as it arrives. It serves a CPU build of vLLM, and any trainer and
engine with no NCCL between them; the trainer side is ``VLLMEngine(url, backend="gloo")``.

wrapkit's package metadata declares it under vLLM's ``vllm.general_plugins`` entry point, which vLLM runs in every
one of its processes, so that with wrapkit installed beside vLLM::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'

takes the syncs. It also mends what vLLM's own reload gets wrong: a failed or partial update (refused, and
abandoned so that the next one starts clean) and, on the CPU build, tied heads and MoE experts left packed from
the previous weights. Nothing here is imported unless vLLM loads the plugin.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["BACKEND", "register", "receive_packed", "abandon_reload", "unloaded_layers", "complete_tied",
           "repack_cpu_experts"]

BACKEND = "gloo"
# Under vLLM's own logger, whose handler prints its records in the server's log.
LOG = logging.getLogger("vllm.wrapkit_gloo")
_Meta = list[tuple[str, str, list[int]]]


def register() -> None:
    """vLLM's plugin hook: the gloo backend in its weight-transfer registry (vLLM may call it more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def _chunks(meta: _Meta, buffer_bytes: int | None) -> Iterator[list[tuple[str, list[int], torch.dtype, int]]]:
    """The sender's cut: pieces accumulate until one takes the chunk past ``buffer_bytes``; the rest closes it.
    ``None``: unpacked, one broadcast per tensor (an empty one too)."""
    pending: list[tuple[str, list[int], torch.dtype, int]] = []
    total = 0
    for name, dtype_name, shape in meta:
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        pending.append((name, list(shape), dtype, size))
        total += size
        if buffer_bytes is None or total > buffer_bytes:
            yield pending
            pending, total = [], 0
    if pending:
        yield pending


def receive_packed(meta: _Meta, group: Any, buffer_bytes: int | None, load: Any) -> tuple[float, float]:
    """Receive one update's chunks from rank 0 of ``group`` and hand each tensor to ``load`` as ``[(name, tensor)]``
    (vLLM's own unpacked receive loads them so, one at a time): a failure names the tensor that failed. Returns
    the seconds spent waiting for the chunks and loading them."""
    import torch.distributed as dist

    waiting = loading = 0.0
    for pieces in _chunks(meta, buffer_bytes):
        packed = torch.empty(sum(p[3] for p in pieces), dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        group.broadcast([packed], opts).wait()
        t1 = time.perf_counter()
        waiting += t1 - t0
        at = 0
        for name, shape, dtype, size in pieces:
            tensor = packed[at: at + size].view(dtype).view(shape)
            at += size
            try:
                load([(name, tensor)])
            except Exception as exc:
                # vLLM passes a worker's error on as str(exc), which is empty for a bare assertion (a shape that
                # does not fit): the trainer is told which tensor failed, and what was raised.
                raise RuntimeError(f"loading {name} {list(shape)} {str(dtype).removeprefix('torch.')} into the "
                                   f"model failed: {exc!r}") from exc
        loading += time.perf_counter() - t1
    return waiting, loading


def unloaded_layers(model: torch.nn.Module) -> list[str]:
    """The layers holding parameters that the current layerwise reload has given no weight (vLLM would keep their
    previous values, log "Failed to load weights" and report the update done)."""
    from vllm.model_executor.model_loader.reload import layerwise

    missing = []
    for path, layer in model.named_modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load() and info.load_numel <= 0 and any(True for _ in layer.parameters(recurse=False)):
            missing.append(path or type(layer).__name__)
    return missing


def complete_tied(model: torch.nn.Module) -> list[str]:
    """Finish the layers whose every parameter is another layer's, loaded by this update (a tied ``lm_head``: the
    checkpoint has no tensor of its own for it). vLLM's reload would put the shared tensor back but not process the
    layer again, and the CPU build computes such a head from a copy packed at start-up: the server would answer
    with the new embedding and the old head. Each is given its tensors back and processed as at start-up. Returns
    their paths."""
    from vllm.model_executor.model_loader.reload import layerwise

    def waiting(layer: torch.nn.Module) -> bool:
        info = layerwise.get_layerwise_info(layer)
        return info.can_load() and info.load_numel <= 0 and info.kernel_tensors is not None

    loaded = {id(p) for layer in model.modules() if not waiting(layer) for p in layer.parameters(recurse=False)}
    completed = []
    for path, layer in model.named_modules():
        if not waiting(layer):
            continue
        info = layerwise.get_layerwise_info(layer)
        assert info.kernel_tensors is not None
        params = info.kernel_tensors[0]
        if not params or any(id(p) not in loaded for p in params.values()):
            continue
        layerwise._place_kernel_tensors(layer, info)
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
        info.reset()
        completed.append(path)
    return completed


def repack_cpu_experts(model: torch.nn.Module) -> list[str]:
    """Pack the experts of each MoE layer again for the CPU build's grouped GEMM. vLLM packs them once, at the first
    load; on a reload it copies the checkpoint's layout into the packed storage and leaves it so (its kernel then
    reads the new values in the wrong order). Call after an update that loaded every layer. Returns their paths."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    packed = []
    for path, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            packed.append(path)
    return packed


def abandon_reload(model: torch.nn.Module) -> int:
    """End a layerwise reload that failed part-way, so that the model serves and the next update starts clean: each
    layer still waiting for weights gets its previous tensors back (vLLM left it on the meta device, where a
    request would crash the engine) and forgets what it buffered (else the next update would replay the failed
    one's tensors and fail again). Returns how many layers were restored. Layers the failed update had completed
    keep its weights."""
    from vllm.model_executor.model_loader.reload import layerwise

    restored = 0
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored


def _engine_class() -> type:
    """Built on first use: its base class is vLLM's, importable only where vLLM is installed."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from ..._errors import first_few
    from ...base.process_groups import join_weight_group
    from ._vllm_dense import gloo_group_name

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):  # type: ignore[misc]
        """vLLM's dense engine over a torch gloo group of the trainer (rank 0) and the workers."""

        timeout = 60.0
        model_update_group: Any

        def init_transfer_engine(self, init_info: Any) -> None:
            self.packed = init_info.packed
            self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
            self.packed_num_buffers = init_info.packed_num_buffers
            if self.model_update_group is not None:  # a new session replaces the old group, as vLLM's does
                self.shutdown()
            config = self.parallel_config
            rank = init_info.rank_offset + config.data_parallel_index * config.world_size + config.rank
            self.model_update_group = join_weight_group(
                init_info.master_address, init_info.master_port, init_info.world_size, rank,
                gloo_group_name(init_info.master_port), "gloo", self.timeout)

        def receive_weights(self, update_info: Any) -> None:
            if self.model_update_group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            meta = list(zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True))
            buffer = self.packed_buffer_size_bytes if self.packed else None  # unpacked: a broadcast per tensor
            loaded = [0]

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                self.model.load_weights(weights)
                loaded[0] += 1

            try:
                waiting, loading = receive_packed(meta, self.model_update_group, buffer, load)
            except Exception as exc:
                restored = abandon_reload(self.model)
                kept = ("its previous weights" if loaded[0] == 0 else
                        f"the {loaded[0]} tensors loaded before it where their layers were complete, its previous "
                        "weights elsewhere")
                raise RuntimeError(f"{exc}; the update was abandoned ({restored} layers restored): the model holds "
                                   f"{kept}, and the next update starts clean") from exc
            t0 = time.perf_counter()
            tied = complete_tied(self.model)  # before the check below: a tied head takes no tensor of its own
            loading += time.perf_counter() - t0
            # A partial update is refused, not reported done. Checked here, where a failure ends vLLM's session (one
            # at finish_weight_update would leave it open): wrapkit's sender, the one trainer side of this backend,
            # sends the whole model in each update.
            missing = unloaded_layers(self.model)
            if missing:
                restored = abandon_reload(self.model)
                raise RuntimeError(f"the update gave no weights to {len(missing)} layers of the served model "
                                   f"({first_few(missing, 6)}): a model of another shape was sent; the update was "
                                   "abandoned "
                                   f"({restored} layers restored to their previous weights, the others keep the "
                                   "update's), and the next update starts clean")
            t0 = time.perf_counter()
            repaired = tied + repack_cpu_experts(self.model)
            loading += time.perf_counter() - t0
            # What the engine's own part of an update costs, beside the transfer (wrapkit bench vllm_real reads it).
            LOG.info("wrapkit gloo update: %d tensors, %d bytes; %.4f s receiving, %.4f s loading (%d layers "
                     "packed again)", len(meta), sum(math.prod(m[2]) * getattr(torch, m[1]).itemsize for m in meta),
                     waiting, loading, len(repaired))

        def shutdown(self) -> None:
            import torch.distributed as dist

            group, self.model_update_group = self.model_update_group, None
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # its peers are gone already: nothing left to release
                    pass

    return GlooWeightTransferEngine


def __getattr__(name: str) -> Any:
    # vLLM's factory looks the class up by name on this module.
    if name == "GlooWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
