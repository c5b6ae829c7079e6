"""Deltas to vLLM's sparse backend (``wrapkit.integrations.vllm.DeltaSync``), against the stand-in of vLLM's
sparse sender and receiver in ``tests/engines/vllm_standin.py``: after every sync the receiver holds, bit for bit,
what a dense sync of the same stream gives."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines import scenarios_engines as se
from tests.harness import _matrix as matrix

# Gathered (FSDP2 on a bf16 wire, ZeRO-3 on a mixture's experts with fp32 norms beside bf16), LoRA merged on the
# way (FSDP1), DDP in bf16 on a tied model, tensor parallelism, pipeline stages.
CASES = [{"spec": "fsdp2", "family": "llama", "wire": "bfloat16"},
         {"spec": "zero3", "family": "qwen3-moe", "wire": "bfloat16", "keep": True},
         {"spec": "fsdp", "family": "llama", "merge": True, "wire": "bfloat16", "lr": 0.5},
         {"spec": "ddp", "family": "qwen2-tied", "precision": "bf16", "lr": 0.1},
         {"spec": "tp", "family": "llama", "wire": "bfloat16"}, {"spec": "pipeline", "family": "llama"}]
# The rest of the family matrix: tied Gemma, the other mixtures, a vision-language model, an encoder-decoder, a
# reward model.
FAMILY_CASES = [{"spec": "fsdp2", "family": f, "wire": "bfloat16"}
                for f in ("gemma3", "gpt-oss", "deepseek-v3", "qwen2-vl", "t5", "llama-reward")]
FOUR_RANK_CASES = [{"spec": "fsdp2", "family": "llama", "topology": "hsdp", "wire": "bfloat16"}]
# FSDP1's flat slices, ZeRO-2's replicated weights and a bf16 ZeRO-3 engine's partitions (its optimizer steps fp32
# masters), diffed on the ranks; a Hub layout given by the trainer that moves elements (diffed on the ranks through
# its index map) and one that computes some (gathered, and said).
MORE_CASES = [{"spec": "fsdp", "family": "llama", "wire": "bfloat16"}, {"spec": "zero2", "family": "llama"},
              {"spec": "fsdp2", "family": "llama", "wire": "bfloat16", "layout": "transposed"},
              {"spec": "zero3", "family": "llama", "layout": "computed"},
              {"spec": "zero3", "family": "qwen2-tied", "precision": "bf16", "lr": 0.1}]

# Other frameworks' models, their values moved by hand between syncs: experts split over their own ranks by
# transformers beside FSDP2 and by hand as torchtitan lays them out (four ranks); Megatron-Core split by tensor
# and by pipeline parallelism (its Hub mapping splits the fused QKV and gate/up projections), its mixture over
# expert-parallel ranks, and tensor by pipeline parallelism on four ranks.
FRAMEWORK_CASES = [{"spec": "ep", "wire": "bfloat16"}, {"spec": "megatron", "tp": 2},
                   {"spec": "megatron", "pp": 2, "wire": "bfloat16"}, {"spec": "megatron", "ep": 2},
                   {"spec": "titan-ep", "ranks": 4}, {"spec": "megatron", "tp": 2, "pp": 2, "ranks": 4}]


def _run(group: Any, case: dict[str, Any]) -> list[list[dict[str, Any]]]:
    per_rank = group.run(se.deltas_through_standin, [case], timeout=240)
    return [obs[repr(sorted(case.items()))] for obs in per_rank]


def _check(case: dict[str, Any], syncs: list[list[dict[str, Any]]]) -> None:
    reports = [[{**s["report"], "seconds": 0} for s in rank] for rank in syncs]
    assert all(r == reports[0] for r in reports)  # agreed on every rank
    world = len(syncs)
    for step, sync in enumerate(syncs[0]):
        report = sync["report"]
        assert sync["wrong"] == [] and sync["extra"] == [] and sync["compared"] > 0, sync
        assert report["dense"] == (step == 0), report
        # Diffed where the weights live (a pipeline stage on its own rank), except merged LoRA and a computed
        # layout: gathered, and said why.
        gathered = case.get("merge") or case.get("layout") == "computed"
        want = "dense" if step == 0 else "gathered" if gathered else "shards"
        assert report["diffed"] == want and (report["why"] is None) == (want != "gathered"), (report["diffed"],
                                                                                            report["why"])
        if want == "gathered" and case.get("layout"):
            assert "is computed from the model's tensors" in report["why"], report["why"]
        if step == 0:
            assert report["changed"] == report["values"] > 0, report
        elif case["spec"].startswith("zero"):  # DeepSpeed's own Adam, at its configured rate: every value moves
            assert 0 < report["changed"] <= report["values"], report
        else:  # a small SGD step: some values change, not all
            assert 0 < report["changed"] < report["values"], report
    snapshots = [rank[-1]["snapshot"] for rank in syncs]  # each rank holds its share only
    assert max(snapshots) - min(snapshots) < 0.1 * max(snapshots) and sum(snapshots) > 0
    assert world * max(snapshots) < 1.2 * sum(snapshots)


@matrix.cases(CASES + FAMILY_CASES + MORE_CASES, [])
def test_deltas_give_what_a_dense_sync_gives(group: Any, case: dict[str, Any]) -> None:
    _check(case, _run(group, case))


@matrix.cases(FOUR_RANK_CASES, [])
def test_deltas_on_four_rank_layouts(group4: Any, case: dict[str, Any]) -> None:
    _check(case, _run(group4, case))


@matrix.cases(FRAMEWORK_CASES, [])
def test_deltas_on_other_frameworks_models(request: Any, tmp_path_factory: Any, case: dict[str, Any]) -> None:
    group = request.getfixturevalue("group4" if case.get("ranks") == 4 else "group")
    tmp = tmp_path_factory.getbasetemp() / "deltas"
    tmp.mkdir(exist_ok=True)
    _check(case, _run(group, {**case, "tmp": str(tmp)}))


def test_a_failed_round_fails_every_rank_and_the_next_is_dense(group: Any) -> None:
    case = {"spec": "fsdp2", "family": "llama", "wire": "bfloat16", "fail_on": 2}
    syncs = _run(group, case)
    for rank in syncs:
        assert [("error" in s) for s in rank] == [False, True, False, False], rank
        assert "EngineError" in rank[1]["error"] and "refused the patches" in rank[1]["error"], rank[1]
        assert rank[2]["report"]["dense"] and not rank[3]["report"]["dense"], rank
    assert syncs[0][2]["wrong"] == [] and syncs[0][3]["wrong"] == []  # whole again after the dense round


def test_a_nan_weight_is_refused_naming_its_tensor_before_it_is_sent(group: Any) -> None:
    """vLLM's sparse patches reserve NaN for unchanged positions and its loader refuses a NaN value: a weight gone
    NaN fails the sparse round and the dense one after it on every rank, naming the tensor, with nothing of its
    bucket sent; once the weight is finite again the next sync is dense and whole."""
    case = {"spec": "fsdp2", "family": "llama", "wire": "bfloat16", "nan": "layers.0.mlp.down_proj"}
    syncs = _run(group, case)
    for rank in syncs:
        assert [("error" in s) for s in rank] == [False, True, True, False], rank
        for sync in rank[1:3]:
            assert "EngineError" in sync["error"] and "model.layers.0.mlp.down_proj.weight holds NaN" in sync["error"]
        assert rank[3]["report"]["dense"], rank[3]
    assert syncs[0][3]["wrong"] == [] and syncs[0][3]["compared"] > 0  # whole again


def test_a_patch_the_engine_drops_is_served_until_the_next_dense_sync(group: Any) -> None:
    case = {"spec": "fsdp2", "family": "llama", "wire": "bfloat16", "drop": "q_proj", "dense_every": 2}
    [mine, _] = _run(group, case)
    assert [s["report"]["dense"] for s in mine] == [True, False, True, False]
    assert mine[0]["wrong"] == [] and mine[2]["wrong"] == []  # the dense rounds restore it
    assert mine[1]["wrong"] and all("q_proj" in n for n in mine[1]["wrong"]), mine[1]["wrong"]


@pytest.mark.parametrize("spec, topology", [("fsdp2", "submesh"), ("ddp", "subgroup")])
def test_a_model_in_sub_groups_is_refused_on_every_rank(group4: Any, tmp_path: Any, spec: str, topology: str) -> None:
    """Two models of a job, each on two ranks: the snapshot's shares are cut over the job's ranks and an engine
    sync's outcome is agreed over them, so a model held by some of them only is refused, by the delta, the adapter
    sync and SGLang's dense sync alike (never diffed against, or agreed with, another model)."""
    for outcomes in group4.run(se.syncs_refused, spec, topology, str(tmp_path), timeout=120):
        assert len(outcomes) == 3 and all(o.startswith("UnsupportedModelError") and "lies over 2 of the job's 4 ranks"
                                          in o for o in outcomes), outcomes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16", "float8_e4m3fn", "int64"])
def test_the_bit_comparison_is_the_same_with_and_without_numpy(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The diff's positions, values and snapshot update agree, bit for bit, through NumPy and through torch's own
    calls (the path without NumPy, and off the CPU); -0.0 against 0.0 and NaNs count as changes by their bits."""
    import torch

    from wrapkit.sync import changes

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(50_000, generator=gen)
    snap = (base * 100).to(dt) if not dt.is_floating_point else base.to(dt)
    now = snap.clone()
    hit = torch.rand(50_000, generator=gen) < 0.3
    now[hit] = (base[hit] * 3 + 1).to(dt) if dt.is_floating_point else (base[hit] * 1000).to(dt)
    if dt.is_floating_point and dt.itemsize > 1:
        snap[:4] = torch.tensor([0.0, float("nan"), 1.0, 2.0]).to(dt)
        now[:4] = torch.tensor([-0.0, float("nan"), 1.0, float("nan")]).to(dt)
    results = []
    for numpy_there in (True, False):
        changes._numpy.cache_clear()
        if not numpy_there:
            monkeypatch.setitem(__import__("sys").modules, "numpy", None)
        assert (changes._numpy() is not None) == numpy_there
        where = changes.changed(now, snap)
        values = changes.take(now, where)
        updated = snap.clone()
        changes.put(updated, where, values)
        results.append((where, values, updated))
        monkeypatch.undo()
    changes._numpy.cache_clear()
    bits = changes.BITS[now.element_size()]
    want = (now.view(bits) != snap.view(bits)).nonzero().flatten()
    assert want.numel() > 10_000
    for where, values, updated in results:
        assert torch.equal(where, want)
        assert torch.equal(values.view(bits), now.view(bits)[want])
        assert torch.equal(updated.view(bits), now.view(bits))  # the snapshot takes in exactly the changes
