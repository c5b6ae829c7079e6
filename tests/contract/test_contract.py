"""The read-only protocol, parametrized over every backend and the nested stacks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import scenarios
from tests.harness._matrix import long
from wrapkit.cli._models import BACKENDS, backend_of, parse_stack

LOCAL = ["plain", "dp", "compile>peft", "peft>compile", "dp>compile>peft"]
DISTRIBUTED = [
    "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3",
    "ddp>compile>peft", "fsdp2>peft", "zero2>peft", "zero3>peft",
    # Long: compile outside DDP is tests/adapters/test_ddp.py's case too, and compile inside FSDP1 takes 8 s of
    # dynamo tracing over flat parameters (compile inside a wrapper runs by default as ddp>compile>peft).
    long("compile>ddp"), long("fsdp>compile"),
]


def expected(spec: str, world: int) -> dict[str, Any]:
    layers = [x for x in parse_stack(spec) if x != "plain"]
    backend_layer = next((x for x in layers if x in BACKENDS), None)
    backend = backend_of(backend_layer) or "plain" if backend_layer else "plain"
    stack = tuple(backend_of(x) or x for x in layers) + ("LlamaForCausalLM",)
    below = layers[layers.index(backend_layer) + 1:] if backend_layer else layers
    keep_compile = next((x for x in below if x in ("compile", "peft")), None)
    distributed = backend not in ("plain", "dp")
    return {
        "backend": backend,
        "stack": stack,
        "unwrap": "PeftModel" if "peft" in below else "LlamaForCausalLM",
        "unwrap_keep_compile": {"compile": "OptimizedModule", "peft": "PeftModel", None: "LlamaForCausalLM"}[
            keep_compile
        ],
        "zero_stage": int(backend_layer[4:]) if backend == "deepspeed" and backend_layer else None,
        "is_sharded": backend_layer in ("fsdp", "fsdp2", "zero3") and world > 1,
        "world_size": world if distributed else 1,
    }


def check(obs: dict[str, Any], spec: str, world: int, rank: int, device: str = "cpu") -> None:
    exp = expected(spec, world)
    for key, value in exp.items():
        assert obs[key] == value, f"{spec}: {key} = {obs[key]!r}, expected {value!r}"
    assert obs["rank"] == rank
    assert obs["module_is_model"] and obs["adapt_again_is_same"] and obs["adapt_twice_equal"]
    assert obs["config_type"] == "LlamaConfig" and obs["config_is_inner"]
    assert obs["is_encoder_decoder"] is False
    assert obs["unwrap_no_peft"] == "LlamaForCausalLM"
    assert obs["device"] == device
    assert obs["num_parameters"] == obs["expected_parameters"] > 0
    assert obs["num_trainable"] == obs["expected_trainable"] > 0
    if "peft" in spec:
        assert obs["num_trainable"] < obs["num_parameters"]
    assert exp["backend"] in obs["describe"] and f"{obs['num_parameters']:,}" in obs["describe"]
    assert obs["is_protocol"]
    if exp["is_sharded"]:
        # This rank's shards: half the model, give or take the padding of each shard.
        assert 0 < obs["resident"] <= obs["full_bytes"] / world + 4096
    else:
        assert obs["resident"] == obs["full_bytes"]
    assert obs["forward_max_diff"] < 1e-4, f"{spec}: forward differs from the plain model"
    if exp["backend"] == "deepspeed":
        assert obs["engine_config_type"] == "dict"


@pytest.mark.parametrize("spec", LOCAL)
def test_contract_local(spec: str) -> None:
    check(scenarios.contract(spec), spec, 1, 0)


@pytest.mark.parametrize("spec", DISTRIBUTED)
def test_contract_distributed(group: Any, spec: str) -> None:
    results = group.run(scenarios.contract, spec, timeout=180)
    for rank, obs in enumerate(results):
        check(obs, spec, group.world_size, rank)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["dp", "ddp", "fsdp", "fsdp2>peft", "zero2", "zero3"])
def test_contract_cuda(gpu_group: Any, spec: str) -> None:
    results = gpu_group.run(scenarios.contract, spec, "wrapkit", "cuda", timeout=300)
    for rank, obs in enumerate(results):
        check(obs, spec, gpu_group.world_size, rank, device=f"cuda:{rank}")


# DeepSpeed's own engines stay alive after the last reference is dropped (it registers them in
# module-level state), with wrapkit or without; the backends below free theirs.
FREED = ["plain", "ddp", "fsdp", "fsdp2", "fsdp2>peft"]


def test_wrapkit_keeps_nothing_alive(group: Any) -> None:
    """A trainer that drops a model (a reference rebuilt each epoch, a policy between runs) gets its
    memory back: no wrapkit operation leaves a reference to the model, its wrapper or its reference."""
    group.run(scenarios.use_and_drop, FREED, timeout=180)
    for per_rank in group.run(scenarios.kept_alive, timeout=60):
        assert per_rank == {spec: [False] * 4 for spec in FREED}, per_rank
