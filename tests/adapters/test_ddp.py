from __future__ import annotations

from typing import Any

from tests.harness import scenarios


def test_compile_outside_ddp_is_peeled_even_with_keep_compile(group: Any) -> None:
    for rank, obs in enumerate(group.run(scenarios.contract, "compile>ddp", timeout=180)):
        assert obs["stack"] == ("compile", "ddp", "LlamaForCausalLM")
        assert obs["unwrap_keep_compile"] == "LlamaForCausalLM"
        assert (obs["world_size"], obs["rank"]) == (2, rank)
