"""stream_full_parameters into a plain transformers model through load_into: every backend, fp32 and
bf16, LoRA merged and not, the multi-node layouts; one collective per bucket."""

from __future__ import annotations

from typing import Any

from tests import scenarios_streaming as ss

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


def check(results: list[dict[str, Any]], cases: list[dict[str, Any]]) -> None:
    for rank, per_case in enumerate(results):
        for case, key in zip(cases, per_case, strict=True):
            obs = per_case[key]
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


def test_stream_every_backend_into_a_plain_model(group: Any) -> None:
    check(group.run(ss.stream_cases, FLAT_CASES, timeout=300), FLAT_CASES)


def test_stream_on_multi_node_layouts(group4: Any) -> None:
    check(group4.run(ss.stream_cases, TOPOLOGY_CASES, timeout=300), TOPOLOGY_CASES)


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

