from __future__ import annotations

import torch

import wrapkit
from wrapkit.cli._models import tiny_llama


def test_dataparallel_on_cpu() -> None:
    model = tiny_llama()
    dp = torch.nn.DataParallel(model)
    wm = wrapkit.adapt(dp)
    # Without GPUs DataParallel keeps no device_ids and runs the module where it is.
    assert wm.device == torch.device("cpu")
    assert (wm.world_size, wm.rank, wm.is_sharded, wm.zero_stage) == (1, 0, False, None)
    assert wm.module is dp and wm.unwrap() is model
