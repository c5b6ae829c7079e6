"""The safetensors dtype names and the torch dtypes they stand for: one table, for the writer
(``pretrained``) and the reader (``reading``), so that whatever one writes the other reads."""

from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_DTYPES", "safetensors_name", "torch_dtype"]


def _table() -> dict[str, torch.dtype]:
    # Some dtypes are newer than the oldest torch supported (the unsigned ones, float8 E8M0):
    # each is in the table only where this torch has it.
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
             "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
    out = {}
    for name, attr in names.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            out[name] = dtype
    return out


SAFETENSORS_DTYPES: dict[str, torch.dtype] = _table()
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_name(dtype: torch.dtype) -> str | None:
    """The safetensors header name of ``dtype``; None where safetensors cannot store it."""
    return _NAMES.get(dtype)


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header name; None where this torch has none for it."""
    return SAFETENSORS_DTYPES.get(name)
