"""stream_full_parameters into a plain transformers model through load_into: every backend, fp32 and
bf16, LoRA merged and not, the multi-node layouts; one collective per bucket."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import _matrix as matrix
from tests.sync import scenarios_streaming as ss

SHARDED = ("fsdp", "fsdp2", "zero3")


def _case(spec: str, **kw: Any) -> dict[str, Any]:
    return {"spec": spec, **kw}


# (spec, precision, dtype, merge, trained)
FLAT_CASES = [
    _case("plain"), _case("ddp"), _case("zero2", precision="bf16", trained=True),
    _case("fsdp"), _case("fsdp2"), _case("zero3"),
    _case("fsdp", precision="bf16", dtype="bf16"), _case("fsdp2", precision="bf16", dtype="bf16", trained=True),
    _case("zero3", precision="bf16", trained=True), _case("zero3", precision="bf16", dtype="bf16"),
    _case("zero3", dtype="bf16", keep_norms=True), _case("fsdp2", dtype="bf16", dst_rank=1),
    _case("ddp>peft"), _case("ddp>peft", merge=True), _case("fsdp>peft", merge=True),
    _case("fsdp2>peft", merge=True, dtype="bf16"), _case("zero3>peft", merge=True), _case("zero3>peft"),
    _case("fsdp2>peft", precision="bf16", merge=True, trained=True),
]
TOPOLOGY_CASES = [
    _case("fsdp2", topology="hsdp"), _case("fsdp2", topology="submesh", precision="bf16", dtype="bf16"),
    _case("fsdp", topology="hsdp"), _case("fsdp", topology="hybrid-groups", precision="bf16"),
    _case("zero3", topology="subgroup"), _case("zero3", topology="flat", precision="bf16", dtype="bf16"),
    _case("fsdp2>peft", topology="hsdp", merge=True),
]


def check(per_rank: list[dict[str, Any]], case: dict[str, Any]) -> None:
    for rank, obs in enumerate(per_rank):
        where = f"rank {rank}, {case}"
        backend = case["spec"].split(">")[0]
        dst = case.get("dst_rank")
        if dst is not None and obs["rank"] != dst:
            assert obs["buckets"] == 0 and obs["loaded"] == [], f"{where}: buckets off dst_rank"
            continue
        assert obs["buckets"] > 1, f"{where}: one bucket only: {obs['sizes']}"
        # Every parameter under the names named_full_parameters() gives (base names when merged).
        assert sorted(obs["loaded"]) == obs["want_params"], f"{where}: {sorted(obs['loaded'])}"
        assert obs["views"], f"{where}: named_tensors() copied"
        bad = [n for n, ok in obs["equal"].items() if not ok]
        assert not bad, f"{where}: the receiver differs from full_state_dict() on {bad}"
        dtypes = set(obs["entries"].values())
        if case.get("keep_norms"):
            assert {obs["entries"][n] for n in obs["entries"] if "norm" in n} == {"torch.float32"}, where
            assert {obs["entries"][n] for n in obs["entries"] if "norm" not in n} == {"torch.bfloat16"}, where
        elif case.get("dtype") == "bf16":
            assert dtypes == {"torch.bfloat16"}, f"{where}: {dtypes}"
        # One collective per bucket where the parameters are sharded (the first also holds the
        # entry: one all-reduce, and one across the replicas of a 2-D layout), none where every
        # rank holds them whole.
        first, *rest = obs["collectives"]
        sharded = backend in SHARDED
        assert first <= 3 and all(c <= 1 for c in rest) and obs["after_last"] == 0, f"{where}: {obs['collectives']}"
        if sharded and not case.get("trained"):
            assert sum(obs["collectives"]) >= obs["buckets"], f"{where}: {obs['collectives']}"
        if not sharded:
            assert sum(rest) == 0, f"{where}: {obs['collectives']}"
        if backend != "fsdp":  # an FSDP1 unit is gathered whole: a bucket holds at least one
            assert max(obs["sizes"]) <= ss.BUCKET, f"{where}: bucket sizes {obs['sizes']}"


@matrix.cases(FLAT_CASES)
def test_stream_full_parameters_into_a_plain_model(request: pytest.FixtureRequest, group: Any,
                                                   case: dict[str, Any]) -> None:
    check(matrix.run(request, group, ss.stream_cases, timeout=300), case)


@matrix.cases(TOPOLOGY_CASES)
def test_stream_full_parameters_on_multi_node_layouts(request: pytest.FixtureRequest, group4: Any,
                                                      case: dict[str, Any]) -> None:
    check(matrix.run(request, group4, ss.stream_cases, timeout=300), case)


def test_stream_of_the_peft_reference_view(group: Any) -> None:
    for obs in group.run(ss.stream_view, timeout=120):
        assert obs == {"names": True, "equal": True}


def test_stream_refuses_bad_arguments_on_every_rank(group: Any) -> None:
    for rank, obs in enumerate(group.run(ss.stream_refusals, timeout=120)):
        assert obs["0"].startswith("ArgumentError") and "bucket_bytes=0" in obs["0"], obs
        assert obs["1"].startswith("ArgumentError") and "dtype" in obs["1"], obs
        assert obs["2"].startswith("ArgumentError") and "dst_rank=7" in obs["2"], obs
        assert obs["3"].startswith("ArgumentError") and "keep_dtype" in obs["3"], obs
        assert obs["4"].startswith("DistributedStateError") and "stream_full_parameters" in obs["4"], obs
        assert "cannot load into LlamaModel" in obs["wrong_receiver"], f"rank {rank}: {obs['wrong_receiver']}"



# -- sleep / wake ----------------------------------------------------------------------------
def deepspeed_moves_states() -> bool:
    """DeepSpeed 0.17 gave ZeRO-1/2 engines ``offload_states``, and ZeRO-3's one for any optimizer."""
    from importlib.metadata import version

    major, minor = (int(x) for x in version("deepspeed").split(".")[:2])
    return (major, minor) >= (0, 17)


TORCH_WAY = {"plain", "ddp", "fsdp", "fsdp2", "zero0"}
SLEEP_CASES = [{"spec": s, "level": lv} for s in ("plain", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3")
               for lv in (1, 2)] + [{"spec": "fsdp2", "level": 1, "precision": "bf16"},
                                    {"spec": "zero3", "level": 2, "precision": "bf16"}]
SLEEP_TOPOLOGY_CASES = [{"spec": "fsdp2", "level": 1, "topology": "hsdp"},
                        {"spec": "fsdp", "level": 2, "topology": "hybrid-groups"},
                        {"spec": "zero3", "level": 1, "topology": "subgroup"}]


def check_sleep(per_rank: list[dict[str, Any]], case: dict[str, Any]) -> None:
    for rank, obs in enumerate(per_rank):
        where = f"rank {rank}, {case}"
        if "error" in obs:
            # DeepSpeed before 0.17 cannot move a ZeRO-1/2 engine's states, nor a ZeRO-3 engine's
            # with another optimizer than its FusedAdam (a GPU build's): refused, with the fix.
            assert case["spec"] in ("zero1", "zero2", "zero3") and not deepspeed_moves_states(), f"{where}: {obs}"
            assert obs["error"].startswith("UnsupportedModelError") and "offload_states" in obs["error"], obs
            continue
        # Training after sleep/wake cycles gives exactly the losses of a run without them.
        assert obs["losses"]["True"] == obs["losses"]["False"], f"{where}: {obs['losses']}"
        assert obs["on_cpu"], f"{where}: something stayed off the CPU while asleep"
        for report in obs["reports"]:
            assert report["state_bytes"] > 0 and 0 <= report["freed_bytes"] <= report["state_bytes"], report
        if case["spec"] in TORCH_WAY:
            # Moved with fresh storage even from the CPU: every parameter, gradient and optimizer
            # state storage of the rank was replaced, none left behind.
            assert all(obs["moved_all"]), f"{where}: kept {obs['kept']}"
            if case["level"] == 1:
                assert all(n > 0 for n in obs["grads_after_sleep"]), f"{where}: gradients lost"
            elif case["spec"] != "zero0":  # an engine's step() clears its gradients itself
                assert all(r["dropped_bytes"] > 0 for r in obs["reports"]), f"{where}: {obs['reports']}"
        if case["level"] == 2:
            assert obs["grads_after_sleep"] == [0] * len(obs["grads_after_sleep"]), f"{where}: gradients kept"


@matrix.cases(SLEEP_CASES)
def test_sleep_wake_keeps_training_exact(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    check_sleep(matrix.run(request, group, ss.sleep_cases, timeout=300), case)


@matrix.cases(SLEEP_TOPOLOGY_CASES)
def test_sleep_wake_on_multi_node_layouts(request: pytest.FixtureRequest, group4: Any, case: dict[str, Any]) -> None:
    check_sleep(matrix.run(request, group4, ss.sleep_cases, timeout=300), case)


def test_a_sleep_report_reads_as_a_sentence() -> None:
    """What sleep() moved, from where to where, and, on the CPU, that nothing could leave the device."""
    from wrapkit import SleepReport

    cpu = str(SleepReport("cpu", 107136, 0, 0))
    assert "107.1 KB" in cpu and "already on the CPU" in cpu and "cannot be measured" in cpu, cpu
    gpu = str(SleepReport("cuda:0", 3 * 10**9, 3 * 10**9, 10**9))
    assert "3.0 GB of the 3.0 GB" in gpu and "on cuda:0 moved to the CPU" in gpu and "1.0 GB of gradients" in gpu, gpu
    assert repr(SleepReport("cpu", 1, 0, 0)).startswith("SleepReport(device='cpu'")  # the fields, for debugging


@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD"])
def test_sleep_under_fsdp1_leaves_no_view_of_the_old_weights(group: Any, strategy: str) -> None:
    """Under NO_SHARD the views a training forward saves for its backward point into the flat
    parameter's own storage; a sleep that moved the flat parameter but not them kept the whole
    model's weights on the GPU (1.75 GiB of a 0.94 B-parameter bf16 Llama on an H100)."""
    for rank, obs in enumerate(group.run(ss.sleep_leaves_nothing_behind, strategy, timeout=120)):
        assert obs["stale"] == [], f"rank {rank}: still on the old storage while asleep: {obs['stale']}"
        assert obs["losses"]["True"] == obs["losses"]["False"], obs["losses"]
