"""PEFT adapter checkpoints: save_pretrained(adapters_only=True) writes PEFT's layout with every rank's
rows, PEFT loads it, and load() resumes from it on every backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.exchange import scenarios_peft as sc
from tests.harness import _matrix as matrix

BACKENDS = ("plain", "ddp", "zero2", "zero3", "fsdp", "fsdp2")
# bf16 on the sharded backends by default, its repeats on the others long.
CASES = [{"spec": b, "precision": p, "topology": "flat"} for b in BACKENDS for p in ("fp32", "bf16")
         if p == "fp32" or b in ("zero3", "fsdp", "fsdp2")]
LONG_CASES = [{"spec": b, "precision": "bf16", "topology": "flat"} for b in ("plain", "ddp", "zero2")]
# The four-rank layouts: two nodes of two devices. HSDP and ZeRO-3's sub-groups by default, the others long.
CASES4 = [{"spec": b, "precision": p, "topology": t} for b, t, p in [
    ("fsdp2", "hsdp", "fp32"), ("zero3", "subgroup", "bf16")]]
LONG_CASES4 = [{"spec": b, "precision": p, "topology": t} for b, t, p in [
    ("fsdp", "hsdp", "fp32"), ("fsdp", "hybrid-groups", "bf16"), ("fsdp2", "submesh", "bf16"),
    ("ddp", "subgroup", "fp32")]]


def check(obs: dict[str, Any], case: dict[str, Any]) -> None:
    rank = obs["rank"]
    for how in ("each", "src0"):
        assert obs[f"adapters_loaded_{how}"], f"rank {rank}: load ({how}) did not restore every adapter tensor"
        assert obs[f"base_untouched_{how}"], f"rank {rank}: load ({how}) of adapters changed a base weight"
    if "files" not in obs:  # a rank that did not write
        return
    assert obs["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                            "second/adapter_config.json", "second/adapter_model.safetensors"] or obs["files"] == [
        "adapter_config.json", "adapter_model.safetensors", "second/adapter_config.json",
        "second/adapter_model.safetensors"], obs["files"]
    assert obs["file_exact"], "adapter_model.safetensors is not PEFT's selection of the trained values"
    assert obs["second_exact"], "second/adapter_model.safetensors is not PEFT's selection of the trained values"
    assert obs["peft_adapters_equal"], "PeftModel.from_pretrained did not get every trained adapter tensor"
    assert obs["peft_outputs_equal"], "the model PEFT loaded computes other outputs than the trained one"
    tol = 1e-4 if case["precision"] == "fp32" else 0.1
    assert obs["policy_diff"] < tol, f"PEFT's model and the wrapped policy differ by {obs['policy_diff']}"


@matrix.cases(CASES, LONG_CASES)
def test_adapters_saved_in_peft_layout_and_resumed(request: pytest.FixtureRequest, group: Any,
                                                    case: dict[str, Any]) -> None:
    for obs in matrix.run(request, group, sc.adapter_checkpoints, timeout=150):
        check(obs, case)


@matrix.cases(CASES4, LONG_CASES4)
def test_adapters_saved_and_resumed_on_four_rank_layouts(request: pytest.FixtureRequest, group4: Any,
                                                         case: dict[str, Any]) -> None:
    for obs in matrix.run(request, group4, sc.adapter_checkpoints, timeout=150):
        check(obs, case)


@pytest.mark.parametrize("spec", ["fsdp2", "zero3"])
def test_bad_adapter_directories_and_arguments(group: Any, spec: str) -> None:
    for obs in group.run(sc.adapter_refusals, spec, timeout=120):
        assert obs["earlier_kept"] and obs["model_unchanged_by_saves"]
        assert "adapter_names=['nope']" in obs["save_unknown_adapter"] and "'second'" in obs["save_unknown_adapter"]
        assert obs["save_merge_too"].startswith("ArgumentError") and "one of the two" in obs["save_merge_too"]
        assert obs["names_without_only"].startswith("ArgumentError")
        # Each refusal with its own type and fix, no other error's hint (a directory's, a save's).
        assert obs["save_no_peft"].startswith("UnsupportedModelError") and "no PEFT layer" in obs["save_no_peft"]
        assert "Pass a directory" not in obs["save_no_peft"], obs["save_no_peft"]
        loaded = obs["load_into_no_peft"]
        assert loaded.startswith("UnsupportedModelError") and "no PEFT layer" in loaded, loaded
        assert "peft.get_peft_model" in loaded and "save" not in loaded.split("no PEFT layer")[1], loaded
        assert "Pass an adapter directory" not in loaded, loaded
        assert obs["save_from_view"].startswith("UnsupportedModelError"), obs["save_from_view"]
        assert "a view with them off; call it on the policy" in obs["save_from_view"]
        assert "Pass a directory" not in obs["save_from_view"], obs["save_from_view"]
        keys = obs["load_keys"]
        assert keys.startswith("StateDictError") and "missing key" in keys and "up_proj.lora_A.weight" in keys
        assert "unexpected key" in keys
        config = obs["load_config"]
        assert "r is 8" in config and "target_modules is ['k_proj', 'q_proj']" in config
        assert "adapter_model.bin" in obs["load_pickle"] and "safe_serialization=True" in obs["load_pickle"]
        assert "no adapter files" in obs["load_empty_named"]
        assert "no checkpoint file or directory" in obs["load_missing"]
        assert obs["load_bad_name"].startswith("StateDictError") and "adapter_name=''" in obs["load_bad_name"]
        assert "holds adapter 'second', which the model lacks" in obs["load_second_into_one"]
        assert obs["unchanged"], "a refused load wrote something"
        assert obs["load_second_by_name"] == obs["load_second_subdir"] == "ok"
        assert obs["second_loaded"] and obs["default_still_zero"]


@pytest.mark.parametrize("spec", ["fsdp", "zero3"])
def test_modules_to_save_copies_go_in_whole(group: Any, spec: str) -> None:
    obs = group.run(sc.modules_to_save, spec, timeout=120)
    assert all(o["resumed"] for o in obs), "a modules_to_save copy or a LoRA matrix was not resumed"
    keys = obs[0]["keys"]
    assert keys == obs[0]["peft_keys"] and any("lm_head" in k for k in keys), keys
    assert obs[0]["outputs_equal"], "PEFT's load of the saved adapters computes other outputs"
    for o in obs:  # the merged exports equal PEFT's merge_and_unload(), the live model untouched
        assert o["merged_full"] == o["merged_stream"] == o["merged_saved"] == o["live_unchanged"] == []


def test_which_directories_are_adapter_checkpoints(tmp_path: Path) -> None:
    """PEFT's layout is recognised at the top and in adapters' subdirectories, never inside a model
    checkpoint (a trainer's output directory holds its checkpoints as subdirectories)."""
    from wrapkit.exchange.peft import adapter_dirs

    def touch(*parts: str) -> None:
        path = tmp_path.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")

    touch("top", "adapter_model.safetensors")
    touch("top", "extra", "adapter_config.json")
    touch("subs", "second", "adapter_model.safetensors")
    touch("model", "model.safetensors")
    touch("model", "checkpoint-10", "adapter_model.safetensors")
    touch("plain", "notes.txt")
    top, subs, model, plain = (str(tmp_path / n) for n in ("top", "subs", "model", "plain"))
    assert adapter_dirs(top, None) == {"default": top, "extra": os.path.join(top, "extra")}
    assert adapter_dirs(subs, None) == {"second": os.path.join(subs, "second")}
    assert adapter_dirs(model, None) is None and adapter_dirs(plain, None) is None
    assert adapter_dirs(subs, "second") == {"second": os.path.join(subs, "second")}
    assert adapter_dirs(top, "other") == {"other": top}
    assert adapter_dirs(plain, "second") == {}
    assert adapter_dirs(str(tmp_path / "missing"), None) is None
