"""Expert parallelism beside FSDP2 as transformers makes it (``DistributedConfig(fsdp_size=N, ep_size=2)``): read as
fsdp2, the experts' own mesh beside fully_shard's, with every operation exact against the checkpoint loaded whole."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness._matrix import long

# The three mixture layouts (Qwen3-MoE's, gpt-oss's with expert biases, DeepSeek-V3's with a dense first layer and
# a router bias buffer), one in bf16, and one on four ranks where each expert is sharded too (efsdp=2, ep=2).
# And on four ranks with tensor parallelism beside them (fsdp=2, tp=2, ep=2).
# The bf16 repeat and four ranks without tensor parallelism are long.
CASES = [("qwen3-moe", "float32", 2, 1), ("gpt-oss", "float32", 2, 1), ("deepseek-v3", "float32", 2, 1),
         ("qwen3-moe", "float32", 4, 2),
         long("qwen3-moe", "bfloat16", 2, 1), long("qwen3-moe", "float32", 4, 1)]


@pytest.mark.parametrize("name, dtype, ranks, tp", CASES)
def test_every_operation_on_experts_split_over_ranks(request: Any, tmp_path_factory: Any, name: str, dtype: str,
                                                     ranks: int, tp: int) -> None:
    group = request.getfixturevalue("group" if ranks == 2 else "group4")
    tmp = tmp_path_factory.getbasetemp() / "experts"
    tmp.mkdir(exist_ok=True)
    results = group.run("tests.parallel.scenarios_experts:expert_ops", str(tmp), name, dtype, tp, timeout=240)
    for rank, r in enumerate(results):
        # The tensor-parallel ranks (innermost) share a batch.
        batches = (rank // tp, ranks // tp)
        assert r["backend"] == "fsdp2" and r["batches"] == batches, (rank, r["backend"], r["batches"])
        assert f"experts:      share {rank % 2} of 2 (expert parallel)" in r["describe"], r["describe"]
        assert r["count"][0] == r["count"][1], r["count"]
        for op in ("full_state_dict", "named_full_parameters", "save_pretrained", "copy_to_whole", "copy_from_whole"):
            assert r[op] == [], (rank, op, r[op][:3])
        assert r["stream"] == {"hub": [], "runtime": []}, (rank, r["stream"])
        loaded, differ = r["load"]
        assert differ == [] and not loaded.missing_keys and not loaded.unexpected_keys, (rank, loaded, differ)
        # Inside gathered() every expert runs (their count is the whole model's), and the split is back after.
        local = r["local_experts"]
        assert r["gathered"] == (0.0, 2 * local) and r["local_after"] == local, (rank, r["gathered"], local)
        assert r["generation"] == {"full": True, "layerwise": True}, (rank, r["generation"])
        assert r["reference"] == ("fsdp2", False, []), (rank, r["reference"])
        assert r["sleep"] == (True, []), (rank, r["sleep"])
        assert r["trained"] < (2e-2 if dtype == "bfloat16" else 1e-5), (rank, r["trained"])


def test_experts_split_by_hand_over_an_ep_mesh_dimension(group4: Any, tmp_path: Any) -> None:
    """torchtitan's layout: the experts on an (efsdp, ep) mesh, each share sharded within it, the rest over all
    four ranks. Exports, loads and copies exact; a copy for a reference is refused (nothing records the split),
    and a reference split the same way is taken as it is."""
    observed = group4.run("tests.parallel.scenarios_experts:titan_expert_ops", str(tmp_path), timeout=180)
    for rank, r in enumerate(observed):
        assert r["backend"] == "fsdp2" and r["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", r
        assert f"experts:      share {rank % 2} of 2" in r["describe"], r["describe"]
        assert r["count"][0] == r["count"][1] and r["gathered"] == 0.0, (rank, r["count"], r["gathered"])
        for op in ("full_state_dict", "named_full_parameters", "stream", "save_pretrained", "copy_to"):
            assert r[op] == [], (rank, op, r[op][:3])
        result, differ = r["load_full_state_dict"]
        assert differ == [] and not result.missing_keys, (rank, r["load_full_state_dict"])
        assert "experts split over their own ranks by hand keep no record" in r["reference_copy"], r["reference_copy"]
        assert r["reference"] == ("fsdp2", []), (rank, r["reference"])
