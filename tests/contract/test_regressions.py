"""Failure #1: `.config` missing on DataParallel, and silently the wrong dict on DeepSpeed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import wrapkit
from tests.harness import scenarios
from wrapkit.cli._models import tiny_llama


def test_failure_1_dataparallel_config() -> None:
    dp = torch.nn.DataParallel(tiny_llama())
    with pytest.raises(AttributeError, match="config"):
        _ = dp.config  # what the Online DPO training step did
    wm = wrapkit.adapt(dp)
    assert wm.config.vocab_size == 128 and wm.config is dp.module.config
    assert wm.is_encoder_decoder is False


def test_failure_1_deepspeed_config_is_not_the_engine_dict(group: Any) -> None:
    for obs in group.run(scenarios.raw_engine_config, timeout=120):
        assert obs["raw_type"] == "dict" and not obs["raw_has_vocab"]  # the trap: no error, wrong object
        assert obs["wm_type"] == "LlamaConfig" and obs["wm_vocab"] == 128
