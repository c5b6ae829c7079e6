"""Sizes and memory budgets: ``"5GB"``-style sizes, and how many bytes a rank may still allocate.

``generation(gather="auto")`` and ``gathered()`` compare what gathering the whole model
would allocate with this budget; ``save_pretrained`` splits its files by a size.
"""

from __future__ import annotations

import os
import re

import torch

from .._errors import ArgumentError

__all__ = ["parse_size", "memory_budget", "BUDGET_ENV", "format_bytes"]

# Overrides the measured budget (bytes, or a size such as "2GB"): to leave room for an
# inference engine on the same device, or to try "layerwise" on a small model.
BUDGET_ENV = "WRAPKIT_MEMORY_BUDGET"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# Part of the device's memory kept free for activations, the KV cache and the allocator.
_MARGIN = 0.10


def parse_size(size: int | str, what: str = "size") -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9) or ``"500MiB"`` (2**20)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ArgumentError(f"{what}={size!r} is not a size; pass bytes as an int or a string such as '5GB'")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ArgumentError(f"{what}={size!r} is not a size; write it as bytes or e.g. '5GB', '500MB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ArgumentError(f"{what}={size!r} must be a positive number of bytes")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def memory_budget(device: torch.device) -> int:
    """Bytes this rank may allocate on ``device`` beyond what it holds: the free memory less a
    margin of 10% of the total; on the CPU the available RAM shared by this host's ranks.
    ``WRAPKIT_MEMORY_BUDGET`` replaces the measurement."""
    override = os.environ.get(BUDGET_ENV)
    if override:
        return parse_size(override, BUDGET_ENV)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - _MARGIN * total))
    info = _meminfo()
    if "MemAvailable" not in info:
        return 1 << 62  # unknown: assume it fits, as before budgets existed
    # Every rank on this host gathers at the same time, into the same RAM.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(0, int((info["MemAvailable"] - _MARGIN * info.get("MemTotal", 0)) / max(local, 1)))
