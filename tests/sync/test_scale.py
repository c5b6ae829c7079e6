"""Models bigger than one device: layerwise generation and the memory budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from tests.harness._matrix import long
from tests.sync import scenarios_scale as ss

# bf16 by default on FSDP2 (plain and with LoRA), its repeats on FSDP1 and ZeRO-3 long.
LAYERWISE_CASES = [("fsdp", "fp32"), long("fsdp", "bf16"), ("fsdp2", "fp32"), ("fsdp2", "bf16"),
                   ("zero3", "fp32"), long("zero3", "bf16"), ("fsdp2>peft", "bf16")]


def _check_layerwise(obs: dict[str, Any], label: str, precision: str) -> None:
    assert "error" not in obs, f"{label}: {obs['error']}"
    assert obs["training_inside"] is False
    assert obs["logits_diff"] == 0.0 and obs["same_tokens"], f"{label}: layerwise decodes differently: {obs}"
    assert obs["same_state"], f"{label}: parameters, hooks, modes or flags changed"
    assert obs["own_diff"] == 0.0, f"{label}: the backend's own forward changed after layerwise"
    # Rank r asked for 3 + 3r new tokens and got them: the ranks that finished first kept
    # stepping (every forward is collective) instead of leaving the others hanging.
    assert obs["ragged"] == [2, 6 + 3 + 3 * obs["rank"]], obs
    units = sorted(ss.unit_bytes(precision), reverse=True)
    bound = obs["rest_bytes"] + units[0] + units[1]
    assert obs["peak_bytes"] <= bound, f"{label}: peak {obs['peak_bytes']} over shard + two units ({bound})"
    assert obs["peak_bytes"] < obs["rest_bytes"] + obs["full_bytes"], f"{label}: layerwise gathered everything"


@pytest.mark.parametrize(("spec", "precision"), LAYERWISE_CASES)
def test_layerwise_equals_full_within_two_units(group: Any, spec: str, precision: str) -> None:
    for obs in group.run(ss.layerwise, spec, precision, timeout=180):
        _check_layerwise(obs, f"{spec} {precision}", precision)


@pytest.mark.parametrize(("spec", "topology"), [
    ("fsdp2", "hsdp"),
    long("fsdp", "hsdp"), long("fsdp2", "submesh")])
def test_layerwise_on_multi_node_layouts(group4: Any, spec: str, topology: str) -> None:
    for obs in group4.run(ss.layerwise, spec, "fp32", topology, timeout=180):
        _check_layerwise(obs, f"{spec} {topology}", "fp32")


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2", "zero3"])
def test_auto_follows_the_memory_budget(group: Any, spec: str) -> None:
    backend = "deepspeed" if spec == "zero3" else spec
    roomy = group.run(ss.auto_choice, spec, None, timeout=180)
    tight = group.run(ss.auto_choice, spec, "10KB", timeout=180)
    for obs in roomy:
        # Enough memory: the whole model is gathered inside, and gathered() is allowed.
        assert obs["chosen"] == [f"generation(gather='auto') on {backend}: full"], obs["chosen"]
        assert obs["gathered"] == obs["full"] == "entered", obs
    for obs in tight:
        [line] = obs["chosen"]
        assert line.startswith(f"generation(gather='auto') on {backend}: layerwise (the gathered model takes"), line
        for key in ("gathered", "full"):
            assert "does not fit" in obs[key] and "gather='layerwise'" in obs[key], obs[key]
    for obs in roomy + tight:
        assert obs["same_tokens"] and obs["training"] is True
        assert "unknown mode" in obs["bad"] and "'layerwise'" in obs["bad"], obs["bad"]


# -- sharded checkpoints in the Hugging Face layout ----------------------------------------
SAVE_CASES = [("fsdp", "fp32"), ("fsdp", "bf16"), ("fsdp2", "fp32"), ("fsdp2", "bf16"), ("zero3", "fp32"),
              ("zero3", "bf16"), ("ddp", "fp32")]


@pytest.mark.parametrize(("spec", "precision"), SAVE_CASES)
def test_save_pretrained_loads_with_from_pretrained_bitwise(group: Any, tmp_path: Path, spec: str,
                                                             precision: str) -> None:
    path = str(tmp_path / "ckpt")
    results = group.run(ss.save_pretrained, spec, precision, path, "20KB", timeout=240)
    obs = results[0]
    assert obs["same_keys"] and obs["bitwise"] == [], obs
    shards = [f for f in obs["files"] if f.endswith(".safetensors")]
    assert shards == obs["index_files"] and len(shards) == 12, obs["files"]
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(obs["files"])
    assert obs["total_size"] == sum(obs["file_bytes"])
    # Each file holds at most max_shard_size, or one tensor alone when that is larger.
    assert all(b <= max(20_000, obs["entry_bytes"]) for b in obs["file_bytes"]), obs["file_bytes"]
    # Both ranks wrote, alternately, each holding at most one file's tensors at a time.
    lines = [r["written"][0] for r in results]
    assert lines[0].startswith("save_pretrained: rank 0 wrote files [1, 3, 5, 7, 9, 11] of 12"), lines
    assert lines[1].startswith("save_pretrained: rank 1 wrote files [2, 4, 6, 8, 10, 12] of 12"), lines
    held = [int(line.rsplit(" ", 2)[-2]) for line in lines]
    assert max(held) <= max(obs["file_bytes"]), (held, obs["file_bytes"])


def test_save_pretrained_merges_adapters(group: Any, tmp_path: Path) -> None:
    obs = group.run(ss.save_pretrained, "fsdp2>peft", "fp32", str(tmp_path / "merged"), "20KB", True,
                    timeout=240)[0]
    # The base model's own class loads it: LoRA merged, the base model's names.
    assert obs["same_keys"] and obs["bitwise"] == [], obs


# Into every backend from each sharded one in fp32; the bf16 repeats (the same reads, half the bytes) are long.
@pytest.mark.parametrize(("spec", "precision"), [c if c[1] == "fp32" else long(*c) for c in SAVE_CASES[:6]])
def test_sharded_checkpoint_loads_into_every_backend(group: Any, tmp_path: Path, spec: str, precision: str) -> None:
    targets = ["plain", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3"]
    results = group.run(ss.cross_load, spec, precision, str(tmp_path / "ckpt"), targets, timeout=400)
    for rank, obs in enumerate(results):
        for i, target in enumerate(targets):
            assert obs[target] == [], f"{spec} {precision} -> {target}: {obs[target][:5]}"
            assert obs[f"{target}_trains"]
            lines = obs[f"{target}_read"]
            if i % 2:  # src_rank=1: rank 1 alone read, every tensor once
                assert len(lines) == rank and all(" read 181376 of the 181376 " in x for x in lines), lines
                continue
            [line] = lines
            done, total = (int(x) for x in line.split(" read ")[1].split(" bytes")[0].split(" of the "))
            if target in ("fsdp", "fsdp2", "zero3"):
                # Its shard's rows and no more (a row cut between two ranks is read by both).
                assert done <= total // 2 + 8 * 1024, (target, line)
            else:
                assert done == total, (target, line)


@pytest.mark.parametrize("spec", ["fsdp", "fsdp2"])
def test_sharded_checkpoint_on_hsdp(group4: Any, tmp_path: Path, spec: str) -> None:
    results = group4.run(ss.hsdp_save, spec, str(tmp_path / "ckpt"), timeout=300)
    for obs in results:
        assert obs["flat"] == [] and obs["hsdp"] == [], obs
    # The first replica (global ranks 0 and 1) wrote every file; the second wrote none.
    written = [[m for m in r["written"] if m.startswith("save_pretrained")] for r in results]
    assert "wrote files [1, 3, 5, 7, 9, 11] of 12" in written[0][0], written
    assert "wrote files [2, 4, 6, 8, 10, 12] of 12" in written[1][0], written
    assert written[2:] == [[], []], written


@pytest.mark.parametrize("spec", ["fsdp2", "zero3"])
def test_bad_checkpoints_raise_everywhere_and_change_nothing(group: Any, tmp_path: Path, spec: str) -> None:
    for obs in group.run(ss.bad_checkpoints, spec, str(tmp_path), timeout=240):
        assert obs["holed"].startswith("StateDictError") and "lacks 1 file" in obs["holed"], obs["holed"]
        assert obs["bad_src"].startswith("StateDictError") and "src_rank=5" in obs["bad_src"], obs["bad_src"]
        assert obs["missing_src"].startswith("StateDictError") and "no checkpoint" in obs["missing_src"], obs
        assert obs["empty_dir"].startswith("StateDictError") and "neither" in obs["empty_dir"], obs["empty_dir"]
        assert "max_shard_size='lots'" in obs["bad_size"], obs["bad_size"]
        assert "is a file" in obs["onto_file"] and "does not exist" in obs["no_parent"]
        assert obs["unchanged"] == [] and obs["good_untouched"] and obs["leftovers"] == [], obs


def test_killed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from wrapkit.cli._models import tiny_llama

    path = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", ss.KILLED_SAVE, str(path), str(ss.LAYERS)], timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    leftovers = [p.name for p in tmp_path.iterdir() if ".wrapkit-tmp-" in p.name]
    assert len(leftovers) == 1, list(tmp_path.iterdir())
    # The previous checkpoint (seed 1) is whole and loads.
    old = tiny_llama(1, layers=ss.LAYERS).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], old[k]) for k in old)
    # The next save sweeps the leftovers, and replaces the checkpoint.
    wrapkit.adapt(tiny_llama(3, layers=ss.LAYERS)).save_pretrained(path, max_shard_size="20KB")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    new = tiny_llama(3, layers=ss.LAYERS).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], new[k]) for k in new)


def test_a_checkpoint_moved_aside_is_put_back(tmp_path: Path) -> None:
    """Where the directory cannot be swapped atomically, the previous one is renamed aside first;
    a kill then leaves it there, and the next save puts it back before anything else."""
    from transformers import AutoModelForCausalLM

    from wrapkit.cli._models import tiny_llama
    from wrapkit.formats.safetensors import sweep

    path = tmp_path / "ckpt"
    wrapkit.adapt(tiny_llama(1, layers=ss.LAYERS)).save_pretrained(path, max_shard_size="20KB")
    os.rename(path, tmp_path / ".ckpt.wrapkit-old-1234abcd")
    (tmp_path / ".ckpt.wrapkit-tmp-5678abcd").mkdir()  # the new one, half written
    sweep(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    old = tiny_llama(1, layers=ss.LAYERS).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], old[k]) for k in old)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp", "zero3"])
def test_load_fills_a_model_never_whole_on_any_rank(group: Any, tmp_path: Path, kind: str) -> None:
    """fully_shard on a meta model, FSDP1 with param_init_fn, deepspeed.zero.Init: load() gives
    exactly the checkpoint's values while each rank only ever holds its shards."""
    for obs in group.run(ss.meta_load, kind, str(tmp_path / "ckpt"), timeout=300):
        assert obs["diff"] == [] and obs["logits"] == 0.0, obs
        assert obs["resident_before"] == obs["resident_after"] == obs["full"] // 2, obs


def test_adapter_disabled_view_saves_the_base_model(group: Any, tmp_path: Path) -> None:
    obs = group.run(ss.view_save, str(tmp_path / "base"), timeout=240)[0]
    assert obs["view"] == "AdapterDisabledView", obs
    assert obs["same_keys"] and obs["diff"] == [] and "config.json" in obs["files"], obs
