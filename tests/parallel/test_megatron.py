"""Megatron-Core models (``GPTModel`` from its local layer specs) on gloo ranks, split over tensor-parallel ranks,
pipeline stages, or both: adapted as the ``megatron`` backend, every export exact against the same weights built
unsplit, and the Hub files they make loaded by transformers with the same logits as Megatron's own forward.

Megatron's CUDA assumptions get CPU stand-ins in ``tests/parallel/megatron_cpu.py``, never in wrapkit."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'wrapkit[megatron]')")

# (style, tp, pp, dtype, wrap): Llama (untied, no biases) and Qwen2 (q/k/v biases, tied head) layouts; bare, in
# Megatron's DDP (over Float16Module in bf16), or the one-element list of chunks get_model() returns.
CASES2 = [("llama", 2, 1, "float32", "none"), ("qwen2", 1, 2, "float32", "chunks"), ("llama", 2, 1, "bfloat16", "ddp"),
          ("qwen2", 2, 1, "float32", "ddp"), ("gpt", 2, 1, "float32", "none"), ("gpt", 1, 2, "float32", "ddp")]
# Four ranks: tensor parallel by pipeline, and tensor parallel by two data-parallel copies.
CASES4 = [("qwen2", 2, 2, "float32", "ddp"), ("llama", 2, 2, "bfloat16", "none"), ("llama", 2, 1, "float32", "ddp")]


def _check(results: list[dict[str, Any]], tp: int, pp: int, dtype: str) -> None:
    copies = len(results) // (tp * pp)
    for rank, r in enumerate(results):
        assert r["backend"] == "megatron" and r["sharded"], (rank, r["backend"])
        assert r["stack"] == ("megatron", "GPTModel"), r["stack"]
        # The group is the tensor-parallel one (the stages lie around it), else the pipeline; one batch for all.
        assert r["world"] == ((tp, rank % tp) if tp > 1 else (pp, rank // copies)), (rank, r["world"])
        # Megatron's order of ranks: tensor-parallel innermost, then the data-parallel copies, then the stages.
        assert r["dp"] == (copies, (rank // tp) % copies), (rank, r["dp"])
        if copies > 1:
            assert f"replicated: copy {(rank // tp) % copies} of {copies}" in r["describe"], r["describe"]
        whole, unsplit = r["count"]
        assert whole == unsplit, (rank, r["count"])
        if pp > 1:
            assert f"pipeline:     stage {rank // tp} of {pp}" in r["describe"], r["describe"]
        if tp > 1:
            assert f"tensor:       rank {rank % tp} of {tp}" in r["describe"], r["describe"]
        assert r["names"] == (True, []), (rank, r["names"])
        assert r["full_diff"] == 0.0 and r["named_equal"], (rank, r["full_diff"])
        if r["style"] == "gpt":
            continue  # no Hub model is named for it (tests below: refused, typed)
        # transformers' model from the Hub files gives Megatron's logits: to rounding in fp32, to bf16's in bf16.
        tolerance = 1e-6 if dtype == "float32" else 2e-2
        assert r["hub_logits_diff"] <= tolerance * r["hub_logits_scale"], (rank, r["hub_logits_diff"])
        assert r["hub_class"] == ("Qwen2ForCausalLM" if "qwen2" in r["style"] else "LlamaForCausalLM"), r["hub_class"]
        assert r["stream_hub"] == (True, 0.0) and r["stream_runtime"], (rank, r["stream_hub"], r["stream_runtime"])
        assert r["load"] == ([], [], 0.0) and r["load_own"] == ([], [], 0.0), (rank, r["load"], r["load_own"])
        # Each rank reads its own rows and columns of every split tensor (the norms whole): 1/(tp*pp) and a little
        # (a tied head on the last stage reads its copy of the embedding's rows too).
        share = 1 / (tp * pp)
        assert share <= r["read_fraction"] <= share + 0.04 and share <= r["read_fraction_own"] <= share + 0.04, r


@pytest.mark.parametrize("style, tp, pp, dtype, wrap", CASES2)
def test_megatron_exports_and_loads_on_two_ranks(group: Any, tmp_path: Any, style: str, tp: int, pp: int, dtype: str,
                                                 wrap: str) -> None:
    _check(group.run("tests.parallel.scenarios_megatron:exports", str(tmp_path), style, tp, pp, dtype, wrap,
                     timeout=120), tp, pp, dtype)


@pytest.mark.parametrize("style, tp, pp, dtype, wrap", CASES4)
def test_megatron_exports_and_loads_on_tp_by_pp(group4: Any, tmp_path: Any, style: str, tp: int, pp: int, dtype: str,
                                                wrap: str) -> None:
    _check(group4.run("tests.parallel.scenarios_megatron:exports", str(tmp_path), style, tp, pp, dtype, wrap,
                      timeout=180), tp, pp, dtype)


def test_megatron_copies_between_splits(group: Any, tmp_path: Any) -> None:
    for r in group.run("tests.parallel.scenarios_megatron:copies", str(tmp_path), timeout=120):
        assert r == {"into_stages": 0.0, "back": 0.0, "slept": (True, True)}, r


@pytest.mark.parametrize("style, tp, pp", [("llama", 2, 1), ("qwen2", 1, 2)])
def test_megatron_generates_in_the_transformers_model(group: Any, tmp_path: Any, style: str, tp: int, pp: int) -> None:
    """generation() and gathered() hold the transformers model of the Hub layout, filled from every rank: Megatron's
    logits, one greedy continuation on every rank, the modes put back; a change in it on rank 0 reaches the slices."""
    results = group.run("tests.parallel.scenarios_megatron:generation_ops", str(tmp_path), style, tp, pp, timeout=120)
    for rank, r in enumerate(results):
        assert r["class"] == ("LlamaForCausalLM" if style == "llama" else "Qwen2ForCausalLM"), r["class"]
        assert r["modes"] == (False, False) and r["restored"], (rank, r["modes"], r["restored"])
        assert r["logits"] < 1e-5, (rank, r["logits"])
        assert r["greedy"] == results[0]["greedy"], rank
        changed, norm, doubled, kept = r["modified"]
        assert changed == ["decoder.final_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight"], \
            changed
        assert norm == 0.0 and doubled == 0.0 and kept, (rank, r["modified"])


@pytest.mark.parametrize("style, tp, pp", [("llama", 2, 1), ("qwen2", 1, 2)])
def test_megatron_reference_is_a_frozen_copy_split_alike(group: Any, tmp_path: Any, style: str, tp: int,
                                                          pp: int) -> None:
    for rank, r in enumerate(group.run("tests.parallel.scenarios_megatron:reference", str(tmp_path), style, tp, pp,
                                       timeout=120)):
        assert r["backend"] == "megatron" and r["stack"] == ("megatron", "GPTModel"), (rank, r["stack"])
        assert r["frozen"] and r["eval"] and r["shared"] == 0 and r["values"], (rank, r)
        assert r.get("logits", 0.0) == 0.0, (rank, r["logits"])


def test_megatron_refusals_are_typed(group: Any, tmp_path: Any) -> None:
    for r in group.run("tests.parallel.scenarios_megatron:refusals", str(tmp_path), timeout=120):
        assert r["gathered"] == "no error", r["gathered"]
        assert "2 Megatron-Core model chunks" in r["chunks"], r["chunks"]
        # Experts whole on each rank beside dense layers split over two: refused, never read as split like them.
        assert r["experts"].startswith("UnsupportedModelError: this Megatron-Core model's experts (decoder.layers.0."
                                       "mlp.experts.local_experts.0.linear_fc1.weight, ...) are split in a way "
                                       "wrapkit does not read yet: expert tensor parallel size 1 over other ranks "
                                       "than tensor parallel size 2"), r["experts"]
        said = r["gpt_save_pretrained"]
        assert said.startswith("UnsupportedModelError: the Megatron-Core model has normalization='LayerNorm', "
                               "position_embedding_type='learned_absolute'"), said
        assert r["gpt_dir"] == "False", "a refused save leaves nothing behind"
        assert r["gpt_gathered"].startswith("UnsupportedModelError: the Megatron-Core model has normalization="), \
            r["gpt_gathered"]
        assert r["gpt_names"].startswith("decoder.final_layernorm.bias,decoder.final_layernorm.weight"), r["gpt_names"]


def _check_mixture(per_rank: list[dict[str, Any]], ep: int) -> None:
    for r in per_rank:
        assert r["backend"] == "megatron" and r["sharded"], r
        assert "experts:      share " in r["describe"] and f"of {ep} (expert parallel)" in r["describe"], r["describe"]
        assert r["count"][0] == r["count"][1], r["count"]
        assert r["megatron_logits"] < 1e-5, r["megatron_logits"]  # the fixture: the same model at every split
        assert r["names"] == [] and r["full_diff"] == 0.0 and r["named_equal"], r
        assert r["hub_class"] == "Qwen3MoeForCausalLM" and r["hub_logits_diff"] < 1e-5, r
        assert r["stream"] == ([], 0.0), r["stream"]
        assert r["loaded"], r
        assert r["generation"][0] == "Qwen3MoeForCausalLM" and r["generation"][1] < 1e-5, r["generation"]
        assert r["reference"] == (True, True), r["reference"]


def test_megatron_experts_over_expert_parallel_ranks(group: Any, tmp_path: Any) -> None:
    """Four experts, two on each rank: named by their global numbers, gathered from their rank, and exchanged with
    transformers' Qwen3-MoE (its per-expert Hub layout) with the logits of the model built whole."""
    _check_mixture(group.run("tests.parallel.scenarios_megatron:mixture_ops", str(tmp_path), 2, 1, timeout=180), 2)


def test_megatron_experts_with_expert_data_parallel_copies(group4: Any, tmp_path: Any) -> None:
    """Four ranks, experts over two of them and two copies of each share (expert data parallel)."""
    _check_mixture(group4.run("tests.parallel.scenarios_megatron:mixture_ops", str(tmp_path), 2, 1, timeout=180), 2)
