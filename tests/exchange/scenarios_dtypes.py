"""Checkpoints holding dtypes other than the model's: float8 tensors loaded into fp32/bf16 models on
every backend, read by every rank or by one (``src_rank``, broadcast as bytes), and a tensor of a
dtype torch cannot hold, refused before anything is written."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._models import build, tiny_llama

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_state(seed: int = 11) -> dict[str, torch.Tensor]:
    """The tiny Llama with its matrices in float8 (both formats, in turn) and its norms in fp32."""
    sd = {k: v.clone() for k, v in tiny_llama(seed).state_dict().items()}
    matrices = [k for k, v in sd.items() if v.dim() == 2]
    for i, k in enumerate(matrices):
        sd[k] = (sd[k] * 8).to(FP8[i % 2])  # scaled into float8's range, where rounding keeps values apart
    return sd


def f4_checkpoint(path: str, base: dict[str, torch.Tensor]) -> None:
    """``base`` as a hand-written safetensors file, plus one last tensor in float4 ("F4"), a dtype
    safetensors names and wrapkit's torch dtype table does not hold."""
    header: dict[str, Any] = {}
    chunks = []
    offset = 0
    for name, t in base.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        st_dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype]
        header[name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header["extra.f4"] = {"dtype": "F4", "shape": [2], "data_offsets": [offset, offset + 1]}
    chunks.append(b"\x00")
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


def fp8_loads(specs: list[str], tmpdir: str) -> dict[str, Any]:
    """For every spec, fp32 and bf16: load the float8 checkpoint read by every rank, then by rank 1
    alone; report the names whose loaded values differ from the file's (cast as ``copy_`` casts)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(tmpdir, "fp8.safetensors")
    bad_path = os.path.join(tmpdir, "f4.safetensors")
    want = fp8_state()
    if me == 0:
        from safetensors.torch import save_file

        save_file(want, path)  # safetensors' own writer
        f4_checkpoint(bad_path, tiny_llama(12).state_dict())
    if dist.is_initialized():
        dist.barrier()
    out: dict[str, Any] = {}
    for spec in specs:
        for precision in ("fp32", "bf16"):
            for one_reads in (False, True):
                wm = wrapkit.adapt(build(spec, seed=3, precision=precision))
                # src_rank is a rank of the model's group: 1 of two, or 0 where the model is one rank's.
                src_rank = (1 if wm.world_size > 1 else 0) if one_reads else None
                wm.load(path, src_rank=src_rank)
                got = wm.full_state_dict(rank0_only=False)
                wrong = [k for k in want if not torch.equal(got[k], want[k].to(torch.float32).to(got[k].dtype))]
                out[f"{spec}/{precision}/src_rank={src_rank}"] = wrong
            # A file with an unreadable dtype last: refused whole, on every rank, nothing written.
            for src_rank in (None, 1 if wm.world_size > 1 else 0):
                before = wm.full_state_dict(rank0_only=False)
                try:
                    wm.load(bad_path, strict=False, src_rank=src_rank)
                    refused = "no error"
                except wrapkit.StateDictError as exc:
                    refused = f"StateDictError: {exc}"
                after = wm.full_state_dict(rank0_only=False)
                changed = [k for k in before if not torch.equal(before[k], after[k])]
                out[f"{spec}/{precision}/f4/src_rank={src_rank}"] = (refused, changed)
    return out
