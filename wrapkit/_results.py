"""What the operations return, as plain data: below the protocol that names them and the operations that build
them, so that neither imports the other."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from .base.memory import format_bytes

__all__ = ["LoadResult", "Bucket", "BucketEntry", "SleepReport", "StateLoad", "entry_bytes", "entry_view"]


class LoadResult(NamedTuple):
    """What a load left out, as torch's ``load_state_dict`` reports it: the model's keys the source did
    not hold (they keep their values), and the source's keys the model has no place for (not read).
    Both are empty after a ``strict`` load, which refuses either."""

    missing_keys: list[str]
    unexpected_keys: list[str]

    @staticmethod
    def of(given: Iterable[str], expected: Iterable[str]) -> LoadResult:
        given, expected = list(given), list(expected)
        have, want = set(given), set(expected)
        return LoadResult([k for k in expected if k not in have], [k for k in given if k not in want])


class BucketEntry(NamedTuple):
    """One tensor of a bucket: its canonical name, full shape, dtype, and byte offset in ``flat``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int


class Bucket(NamedTuple):
    """One flat ``uint8`` tensor and the tensors packed in it. Tied parameters are packed once,
    with one entry per name at the same offset."""

    flat: torch.Tensor
    entries: list[BucketEntry]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every entry: views into ``flat``, no copies."""
        for e in self.entries:
            yield e.name, entry_view(self.flat, e)


def entry_bytes(e: BucketEntry) -> int:
    return math.prod(e.shape) * e.dtype.itemsize


def entry_view(flat: torch.Tensor, e: BucketEntry) -> torch.Tensor:
    return flat[e.offset: e.offset + entry_bytes(e)].view(e.dtype).view(e.shape)


class SleepReport(NamedTuple):
    """What ``sleep()`` did on this rank. ``state_bytes``: its parameters, gradients and optimizer
    state on the compute device before; ``freed_bytes``: how much of that left the device (on a
    CPU-only machine the device is the CPU, so nothing can leave it); ``dropped_bytes``: the
    gradients level 2 let go."""

    device: str
    state_bytes: int
    freed_bytes: int
    dropped_bytes: int

    def __str__(self) -> str:
        """One sentence: what was moved, from where to where, and what could not be measured."""
        state, dropped = format_bytes(self.state_bytes), format_bytes(self.dropped_bytes)
        grads = f"; {dropped} of gradients dropped (level 2)" if self.dropped_bytes else ""
        if self.device == "cpu":
            return (f"asleep: {state} of parameters, gradients and optimizer state, already on the CPU, so nothing "
                    f"left the device and the freed memory cannot be measured here{grads}")
        return (f"asleep: {format_bytes(self.freed_bytes)} of the {state} of parameters, gradients and optimizer "
                f"state on {self.device} moved to the CPU{grads}")


class StateLoad(NamedTuple):
    """What ``load_state`` returns: the ``extra`` dict given to ``save_state``, and what it did not restore
    (``skipped``: each item says what and why, e.g. a rank the saving job did not have has no RNG state)."""

    extra: dict[str, Any]
    skipped: list[str]
