"""The sending side of a sparse update to vLLM over gloo: ``DeltaSync``'s patches to a server whose backend is
wrapkit's ``sparse_gloo`` (``VLLMEngine.send_patches``), through the group and the control calls of the dense
sender."""

from __future__ import annotations

from typing import Any

import torch

from ..._errors import ArgumentError, EngineError
from ._engine_wire import in_thread, why
from ._vllm_dense import DenseSender

__all__ = ["send_patches"]


def send_patches(sender: DenseSender, patches: list[Any]) -> None:
    """One sparse update (``DeltaSync``'s patches; the sending rank only) to a server whose backend is wrapkit's
    ``sparse_gloo``, over the group ``connect()`` joined: each patch's int32 positions, then its values, one
    broadcast each (none for an empty one), applied in place by the workers. Paused, checked and resumed as
    a dense sync is. Raises ``EngineError`` with the server's reason."""
    if sender.wire is None or not sender.connected:
        raise ArgumentError("VLLMEngine.send_patches() before connect(): call connect() on every rank first")
    if not patches:
        return
    sender.syncs += 1
    version = f"wrapkit-{sender._tag}-{sender.syncs}"
    error, box, thread, paused = None, None, None, False
    try:
        paused = sender._pause()
        sender._expect(sender._call("start_weight_update", {}), "start_weight_update")
        info = {"names": [p.name for p in patches],
                "dtype_names": [str(p.values.dtype).removeprefix("torch.") for p in patches],
                "shapes": [list(p.full_shape) for p in patches],
                "num_updates_list": [int(p.indices.numel()) for p in patches]}
        box, thread = in_thread(lambda: sender._call("update_weights", {"update_info": info}))
        for p in patches:
            for part in (p.indices, p.values):
                if error is None and part.numel():
                    error = sender._send([part.contiguous().view(-1).view(torch.uint8)], box)
    except Exception as exc:
        error = why(exc)
    error = sender._end(error, box, thread, version, paused, len(patches), len(patches), [])
    if error is not None:
        if sender.broken:  # the group is out of step: left on this rank, to be joined again by every rank
            sender.close()
            sender.broken = False
            error += "; the transfer group was left: connect() again on every rank"
        raise EngineError(f"VLLMEngine.send_patches() at {sender.url}: {error}")
