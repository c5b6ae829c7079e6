"""The model-family matrix: tied, mixture-of-experts, vision-language, encoder-decoder and reward models on
every backend, exchanged in the Hub's layout (what transformers' own save writes) both ways."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.exchange import scenarios_families as sc
from tests.harness import _matrix as matrix
from wrapkit.cli._families import FAMILIES

# DDP holds the same whole module on each rank as the plain model does: its family cases repeated the plain
# ones (the contract and loop-state matrices cover DDP itself), at 1-2 s each.
# The default selection: every family whole (plain), under DTensor shards (FSDP2) and under ZeRO-3's partitions;
# FSDP1's flat parameters (whose layout the loop-state and contract matrices cover) and the bf16 repeats are long.
BACKENDS = ("plain", "fsdp2", "zero3")
# ZeRO-3's exchange is the matrix's slowest (an engine per family): by default on one family of each kind (tied,
# fused experts, vision-language, encoder-decoder, reward head); its repeats on the other tied, expert and
# vision-language families are long (their references run under ZeRO-3 by default, below).
ZERO3_REPEATS = ("gemma3", "gpt-oss", "deepseek-v3", "llava")
CASES = [{"family": f, "spec": b, "precision": "fp32"} for f in FAMILIES if f != "llama" for b in BACKENDS
         if not (b == "zero3" and f in ZERO3_REPEATS)]
LONG_CASES = [{"family": f, "spec": "zero3", "precision": "fp32"} for f in ZERO3_REPEATS]
LONG_CASES += [{"family": f, "spec": "fsdp", "precision": "fp32"} for f in FAMILIES if f != "llama"]
# bf16 on the sharded backends that cast per family at run time (FSDP1's mixed precision is the loop-state
# matrix's, on the Llama).
LONG_CASES += [{"family": f, "spec": b, "precision": "bf16"} for f in FAMILIES if f != "llama"
               for b in ("fsdp2", "zero3")]


@matrix.cases(CASES, LONG_CASES)
def test_family_exchanges_in_the_hub_layout(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    for obs in matrix.run(request, group, sc.family_exchange, timeout=900):
        rank = obs["rank"]
        assert obs["save"] == [], f"rank {rank}: save_pretrained differs from transformers' own save: {obs['save']}"
        for how in ("each", "src0"):
            assert obs[f"load_{how}"] == [], f"rank {rank}: load ({how}) of transformers' save: {obs[f'load_{how}']}"
            assert obs[f"logits_{how}"] == 0.0, f"rank {rank}: the loaded model computes other logits"
            assert obs.get(f"tied_{how}", True), f"rank {rank}: load ({how}) untied the tied weights"
        assert obs["load_full_state_dict"] == [] and obs["copy_to"] == [], (obs["load_full_state_dict"], obs["copy_to"])
        tol = 1e-6 if case["precision"] == "fp32" else 1e-2
        assert obs["ema"] <= tol and obs["ema_tied"], f"rank {rank}: the EMA is off by {obs['ema']} or untied"
        if case["spec"] in ("fsdp", "fsdp2", "zero3"):
            # Each of two ranks reads about its half: a fused expert parameter from its experts' tensors alone.
            assert obs["read_fraction"] < 0.6, f"rank {rank} read {obs['read_fraction']:.0%} of the checkpoint"
        assert obs["stream"] == [], f"rank {rank}: the default stream is not the Hub's layout: {obs['stream']}"
        for layout in ("hub", "runtime"):
            assert obs[f"load_into_{layout}"] == [], f"rank {rank}: load_into ({layout}): {obs[f'load_into_{layout}']}"


@pytest.mark.parametrize("family", ["llava", "qwen3-moe", "qwen2-vl", "qwen2-tied"])
def test_a_model_from_pretrained_saves_with_the_conversions_it_was_loaded_with(tmp_path: Any, family: str) -> None:
    """from_pretrained records the conversions it used (legacy renames included); wrapkit's save reverts
    those, as transformers' own save does."""
    import wrapkit
    from wrapkit.cli._families import family_model

    family_model(family, 4).save_pretrained(tmp_path / "hub")
    loaded = type(family_model(family, 5)).from_pretrained(tmp_path / "hub")
    assert getattr(loaded, "_weight_conversions", None) is not None or family == "qwen2-tied"
    loaded.save_pretrained(tmp_path / "theirs")
    wrapkit.adapt(loaded).save_pretrained(tmp_path / "ours")
    assert sc._differences(sc._files(str(tmp_path / "ours")), sc._files(str(tmp_path / "theirs"))) == []


REFERENCE_CASES = [{"family": f, "spec": b, "precision": p} for f in FAMILIES if f != "llama"
                   for b, p in [("plain", "fp32"), ("fsdp2", "fp32"), ("zero3", "fp32")]]
LONG_REFERENCE_CASES = [{"family": f, "spec": b, "precision": p} for f in FAMILIES if f != "llama"
                        for b, p in [("fsdp", "fp32"), ("zero3", "bf16")]]


@matrix.cases(REFERENCE_CASES, LONG_REFERENCE_CASES)
def test_family_references(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    """A reference (or reward model) prepared from the policy computes the policy's logits, on every family
    and backend: under ZeRO-3 a Gemma 3 or sequence-classification reference had failed its first forward."""
    for obs in matrix.run(request, group, sc.family_references, timeout=900):
        assert "error" not in obs, f"rank {obs['rank']}: {obs.get('error')}"
        tol = 0.0 if case["precision"] == "fp32" else 0.05
        assert obs["diff"] <= tol, f"rank {obs['rank']}: the reference's logits differ by {obs['diff']}"
        assert obs["frozen"]
        assert obs.get("refused", True) is True, f"rank {obs['rank']}: a modified model's reference: {obs['refused']}"


MIXTURES = ("qwen3-moe", "gpt-oss", "deepseek-v3")
EXPERT_CASES = [{"family": f, "spec": b, "precision": "fp32"} for f in MIXTURES for b in BACKENDS]
LONG_EXPERT_CASES = [{"family": f, "spec": "fsdp", "precision": "fp32"} for f in MIXTURES]


@matrix.cases(EXPERT_CASES, LONG_EXPERT_CASES)
def test_lora_on_experts(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    """PEFT's target_parameters on the fused experts: every merged export equals PEFT's merge_and_unload (in
    the Hub's layout where transformers' save writes it), and the adapters alone PEFT's own save, both ways."""
    for obs in matrix.run(request, group, sc.expert_adapters, timeout=900):
        for what in ("full_state_dict", "stream", "save_merged", "save_adapters", "load_adapters"):
            assert obs[what] == [], f"rank {obs['rank']}: {what}: {obs[what][:5]}"


def test_a_broken_hub_checkpoint_is_refused_with_every_problem(tmp_path: Any) -> None:
    """A per-expert checkpoint lacking one expert's tensor and holding another of the wrong shape: both named
    (the experts counted), with the fused parameters they build reported missing, and nothing written, even
    with strict=False."""
    import torch
    from safetensors.torch import load_file, save_file

    import wrapkit
    from wrapkit import StateDictError
    from wrapkit.cli._families import family_model

    family_model("qwen3-moe", 1).save_pretrained(tmp_path)
    [file] = [f for f in tmp_path.iterdir() if f.suffix == ".safetensors"]
    sd = load_file(file)
    del sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    cut = "model.layers.0.mlp.experts.2.down_proj.weight"
    sd[cut] = sd[cut][:, :8].contiguous()
    save_file(sd, file, metadata={"format": "pt"})
    model = family_model("qwen3-moe", 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(StateDictError) as caught:
            wrapkit.adapt(model).load(tmp_path, strict=strict)
        text = str(caught.value)
        assert "nothing was written" in text
        assert "3 of the 4 per-expert tensors 'mlp.experts.*.up_proj.weight'" in text, text
        assert "'model.layers.0.mlp.experts.down_proj'" in text and "do not convert" in text, text
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_of_this_architecture_in_another_layout_is_named_so(tmp_path: Any) -> None:
    """Keys that no conversion of this transformers maps, in a directory whose config.json names the model's
    own architecture: the error says the layouts differ, not the models."""
    from safetensors.torch import load_file, save_file

    import wrapkit
    from wrapkit import StateDictError
    from wrapkit.cli._families import family_model

    family_model("llama", 1).save_pretrained(tmp_path)
    [file] = [f for f in tmp_path.iterdir() if f.suffix == ".safetensors"]
    save_file({k.replace("model.layers.", "model.blocks."): v for k, v in load_file(file).items()}, file,
              metadata={"format": "pt"})
    with pytest.raises(StateDictError) as caught:
        wrapkit.adapt(family_model("llama", 2)).load(tmp_path)
    assert "names this model's architecture (LlamaForCausalLM)" in str(caught.value), caught.value
    assert "missing key 'model.layers.0.self_attn.q_proj.weight'" in str(caught.value)


def test_the_layout_is_looked_up_once_and_keeps_no_model_alive() -> None:
    """transformers' mapping is looked up once per model (a weight sync every few steps reads it each time),
    and the cached mapping does not keep the model alive."""
    import gc
    import weakref

    from wrapkit.cli._families import family_model
    from wrapkit.formats.hub import _DEFAULTS, HubLayout

    model = family_model("qwen3-moe")
    first = HubLayout.of(model)
    assert first is not None and model in _DEFAULTS
    second = HubLayout.of(model)
    assert second is not None and all(a is b for a, b in zip(second.conversions, first.conversions, strict=True))
    gone = weakref.ref(model)
    del model, first, second
    gc.collect()
    assert gone() is None


def test_a_hooked_model_with_lora_exports_merged_as_its_own_state_dict(tmp_path: Any) -> None:
    """LoRA on the fused projection of llama-fused (and on q_proj): merged, full_state_dict, the stream and
    save_pretrained give what PEFT's merge_and_unload().state_dict() gives (the model's hooks split the merged
    gate_up_proj), and the saved directory loads into a fresh model; unmerged, the PEFT model's own state dict."""
    import copy

    import peft

    import wrapkit
    from wrapkit.cli._families import family_model

    pm = peft.get_peft_model(family_model("llama-fused", 0), peft.LoraConfig(target_modules=["gate_up_proj", "q_proj"],
                                                                            r=4))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    wm = wrapkit.adapt(pm)
    merged = wm.full_state_dict(merge_adapters=True)
    assert sorted(merged) == sorted(want) and "model.layers.0.mlp.gate_proj.weight" in merged
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    streamed = {n: t.clone() for b in wm.stream_full_parameters(bucket_bytes=4096, merge_adapters=True)
                for n, t in b.named_tensors()}
    assert streamed and all(torch.allclose(streamed[k], want[k], atol=1e-6) for k in streamed)
    wm.save_pretrained(tmp_path / "merged", merge_adapters=True)
    fresh = family_model("llama-fused", 5)
    wrapkit.adapt(fresh).load(tmp_path / "merged")
    assert all(torch.allclose(fresh.state_dict()[k], want[k], atol=1e-6) for k in want)
    assert sorted(wm.full_state_dict()) == sorted(pm.state_dict())
