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

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["BACKEND", "SPARSE_BACKEND", "register", "keep_cpu_weights", "receive_packed", "abandon_reload",
           "unloaded_layers", "complete_tied", "repack_cpu_experts"]

BACKEND = "gloo"
SPARSE_BACKEND = "sparse_gloo"
# Under vLLM's own logger, whose handler prints its records in the server's log.
LOG = logging.getLogger("vllm.wrapkit_gloo")
_Meta = list[tuple[str, str, list[int]]]


def register() -> None:
    """vLLM's plugin hook: the gloo backends in its weight-transfer registry (vLLM may call it more than once), and
    on the CPU build the linear layers' dispatch for the sparse one (``keep_cpu_weights``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((BACKEND, "GlooWeightTransferEngine"), (SPARSE_BACKEND, "SparseGlooWeightTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, __name__, cls)
        except ValueError:  # already registered in this process
            pass
    keep_cpu_weights()


def keep_cpu_weights(everywhere: bool = False) -> None:
    """Where the server's backend is ``sparse_gloo``, the CPU build's linear layers compute from their own weights
    (vLLM's own fallback, ``F.linear``) instead of a copy packed at load: sparse patches are written into those
    weights in place, through the model's loaders, which the packing takes away. Other servers are left as
    vLLM builds them. The dispatch is looked up by vLLM when each layer is processed, so this takes effect for
    the model built after it.

    ``everywhere=True``: every engine built in this process from now on (an in-process engine of a colocated
    trainer, whose syncs call the model's ``load_weights``: on packed layers it raises, as their weights have no
    loader left)."""
    global _PACKED, _EVERYWHERE
    _EVERYWHERE = _EVERYWHERE or everywhere
    try:
        from vllm.model_executor.layers import utils
    except Exception:  # a vLLM without the CPU dispatch: nothing to change
        return
    current = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if current is None or current is _dispatch:
        return
    _PACKED = current
    utils.dispatch_cpu_unquantized_gemm = _dispatch


_PACKED: Any = None  # vLLM's own dispatch, which _dispatch calls for the other servers
_EVERYWHERE = False  # keep_cpu_weights(everywhere=True) was called in this process


def _dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    weight = getattr(layer, "weight", None)
    if (_EVERYWHERE or _configured_backend() == SPARSE_BACKEND) and weight is not None and weight.ndim == 2:
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
        return
    _PACKED(layer, remove_weight)


def _configured_backend() -> str | None:
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config().weight_transfer_config
    except Exception:  # outside a vLLM config's context: no server is being built
        return None
    return getattr(config, "backend", None)


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


def _got_nothing(layer: torch.nn.Module) -> bool:
    """Whether the current layerwise reload waits for ``layer`` and has given it no weight yet."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.get_layerwise_info(layer)
    return bool(info.can_load() and info.load_numel <= 0)


def unloaded_layers(model: torch.nn.Module) -> list[str]:
    """The layers holding parameters that the current layerwise reload has given no weight (vLLM would keep their
    previous values, log "Failed to load weights" and report the update done)."""
    return [path or type(layer).__name__ for path, layer in model.named_modules()
            if _got_nothing(layer) and any(True for _ in layer.parameters(recurse=False))]


def complete_tied(model: torch.nn.Module) -> list[str]:
    """Finish the layers whose every parameter is another layer's, loaded by this update (a tied ``lm_head``: the
    checkpoint has no tensor of its own for it). vLLM's reload would put the shared tensor back but not process the
    layer again, and the CPU build computes such a head from a copy packed at start-up: the server would answer
    with the new embedding and the old head. Each is given its tensors back and processed as at start-up. Returns
    their paths."""
    from vllm.model_executor.model_loader.reload import layerwise

    def waiting(layer: torch.nn.Module) -> bool:  # and with tensors of its own to put back
        return _got_nothing(layer) and layerwise.get_layerwise_info(layer).kernel_tensors is not None

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
    packed = _packed_experts(model)
    layers = dict(model.named_modules())
    for path in packed:
        layers[path].quant_method.moe_kernel.fused_experts.process_weights_after_loading(layers[path])
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


@functools.cache
def _engine_class() -> type:
    """Built on first use: its base class is vLLM's, importable only where vLLM is installed."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from ..._errors import first_few
    from ...base.process_groups import join_weight_group
    from ._vllm_wire import gloo_group_name

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


def _sparse_engine_class() -> type:
    """vLLM's sparse engine (patches applied in place, no reload) over the gloo group of the dense one."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from ..._errors import first_few

    dense: Any = _engine_class()

    class SparseGlooWeightTransferEngine(SparseNCCLWeightTransferEngine):  # type: ignore[misc]
        """Sparse patches (``VLLMEngine.send_patches``, ``DeltaSync``) over a torch gloo group."""

        model_update_group: Any
        timeout = dense.timeout
        shutdown = dense.shutdown

        def init_transfer_engine(self, init_info: Any) -> None:
            experts = _packed_experts(self.model)
            if experts:
                raise RuntimeError("sparse updates cannot patch the CPU build's MoE experts "
                                   f"({first_few(experts, 2)}): it keeps them packed for its grouped GEMM, not in "
                                   "the checkpoint's layout; "
                                   "serve this model with the dense gloo backend")
            dense.init_transfer_engine(self, init_info)

        def receive_weights(self, update_info: Any) -> None:
            import torch.distributed as dist

            if self.model_update_group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            patches = []
            for name, dtype_name, shape, n in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                                  update_info.num_updates_list, strict=True):
                dtype = getattr(torch, dtype_name)
                parts = []
                for part_dtype in (torch.int32, dtype):
                    raw = torch.empty(n * part_dtype.itemsize, dtype=torch.uint8)
                    if n:
                        opts = dist.BroadcastOptions()
                        opts.rootRank = 0
                        self.model_update_group.broadcast([raw], opts).wait()
                    parts.append(raw.view(part_dtype))
                patches.append(CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=dtype, values=parts[1],
                                                     indices=parts[0]))
            load_checkpoint_weight_patches(self.model, patches)

    return SparseGlooWeightTransferEngine


def _packed_experts(model: torch.nn.Module) -> list[str]:
    """The paths of the MoE layers whose experts the CPU build packs for its grouped GEMM."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return [path for path, layer in model.named_modules()
            if isinstance(getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts",
                                  None), CPUUnquantizedExperts)]


_CLASSES: dict[str, Callable[[], type]] = {"GlooWeightTransferEngine": _engine_class,
                                           "SparseGlooWeightTransferEngine": _sparse_engine_class}


def __getattr__(name: str) -> Any:
    # vLLM's factory looks the classes up by name on this module.
    if name in _CLASSES:
        cls = _CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
