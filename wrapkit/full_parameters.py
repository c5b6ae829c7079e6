"""Full parameters on every rank: ``gathered()`` and ``generation()``, on every backend.

Written against the backend primitives: ``gather_full`` makes every parameter full (and
writes back from ``modifier_rank``), ``gather_bypass`` says whether the module must be taken
out of the backend's hooks to run on them (``_gather.bypassed``). Both contexts put every
submodule's ``training`` flag back on exit, and ``generation()`` also gradient checkpointing,
whatever the body did, exception or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ._agree import check_modifier_rank
from ._gather import bypassed, generation_modes, restore_modes

if TYPE_CHECKING:
    from .adapters._base import Adapter

__all__ = ["gathered", "generation"]


@contextlib.contextmanager
def gathered(wm: Adapter, modifier_rank: int | None = None) -> Iterator[torch.nn.Module]:
    """``wm.unwrap()`` holding the full parameters on every rank; see ``WrappedModel.gathered``."""
    check_modifier_rank(modifier_rank, wm.world_size, wm.process_group(), wm.replica_groups())
    # Modes are restored too: code inside often calls eval() to run the model and forgets train().
    modes = [(m, m.training) for m in wm.module.modules()]
    try:
        with wm.gather_full(modifier_rank) as replace:
            if wm.gather_bypass():
                with bypassed(wm.unwrap(), replace) as inner:
                    yield inner
            else:
                yield wm.unwrap()
    finally:
        restore_modes(modes)


@contextlib.contextmanager
def generation(wm: Adapter) -> Iterator[torch.nn.Module]:
    """``gathered()`` plus eval mode, no autograd and gradient checkpointing off; see ``WrappedModel.generation``."""
    with gathered(wm) as inner, generation_modes(wm.module):
        yield inner
