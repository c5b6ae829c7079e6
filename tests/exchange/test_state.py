"""Weights in and out: full_state_dict, load_full_state_dict, save/load, copy_to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from tests.exchange import scenarios_state as sc
from tests.harness import _matrix as matrix


@pytest.fixture
def shared_dir(tmp_path: Path) -> str:
    """A directory both ranks see (same machine)."""
    return str(tmp_path)


def check_export(facts: dict[str, Any], b: str, rank: int, tol: float = 1e-5) -> None:
    """What backend ``b`` exports and saves is the plain model's state dict, and loading its own file
    back leaves a model whose forward is the plain model's."""
    assert facts["fsd_equal"], f"rank {rank}: {b}.full_state_dict() != the plain model's state_dict()"
    assert facts["rank0_only_empty"], f"rank {rank}: {b}.full_state_dict(rank0_only=True) wrong"
    assert facts["rank_of"] == (0 if b == "plain" else rank)
    assert facts["file_equal"], f"{b}.save() file differs from the weights"
    assert facts["plain_loads_file"], f"{b}.save() file not loadable by the plain model"
    assert facts["forward"] < tol, f"{b}: forward after load differs by {facts['forward']}"


def check_matrix(results: list[dict[str, Any]], tol: float = 1e-5) -> None:
    for obs in results:
        for b in sc.MATRIX:
            check_export({k: obs[k][b] for k in sc.EXPORT_FACTS}, b, obs["rank"], tol)
        failed = [pair for pair, ok in obs["pairs"].items() if not ok]
        assert len(obs["pairs"]) == 49 and not failed, f"rank {obs['rank']}: pairs not bitwise equal: {failed}"


# Save on one backend, load on another: 49 cases, one id each (``test_save_then_load_bitwise[zero3-load=fsdp]``),
# run together.
SAVE_LOAD_CASES = [{"spec": t, "load": s} for t in sc.MATRIX for s in sc.MATRIX]


@matrix.cases(SAVE_LOAD_CASES)
def test_save_then_load_bitwise(request: pytest.FixtureRequest, group: Any, case: dict[str, Any]) -> None:
    for obs in matrix.run(request, group, sc.matrix_cases, timeout=400):
        assert obs["pair"], f"rank {obs['rank']}: {case['load']}.save() loaded into {case['spec']} is not bitwise equal"
        if case["load"] == case["spec"]:
            check_export(obs, case["spec"], obs["rank"])


@pytest.mark.gpu
def test_matrix_49_pairs_bitwise_gpu(gpu_group: Any, shared_dir: str) -> None:
    # GPU kernels differ slightly between wrapped and plain forward; the weights must not.
    check_matrix(gpu_group.run(sc.matrix, shared_dir, "cuda", timeout=500), tol=1e-4)


@pytest.mark.parametrize(
    "pairs",
    [
        [("zero3", "zero3"), ("fsdp", "fsdp2"), ("zero2", "plain")],
        [("fsdp2", "zero3"), ("zero3", "fsdp"), ("plain", "zero1"), ("ddp", "fsdp2"), ("fsdp2", "fsdp2")],
        # On two ranks FSDP2 beside tensor parallelism shards over a dp dimension of one rank.
        [("tp", "fsdp2"), ("zero3", "tp"), ("tp", "tp"), ("tp", "fsdp2+tp"), ("fsdp2+tp", "tp"),
         ("fsdp2+tp", "fsdp2+tp")],
    ],
    ids=["required", "more", "tp"],
)
def test_copy_to_ema_and_exact(group: Any, pairs: list[tuple[str, str]]) -> None:
    check_copies(group.run(sc.copy_pairs, pairs, 0.25, timeout=300))


@pytest.mark.gpu
def test_copy_to_ema_and_exact_gpu(gpu_group: Any) -> None:
    pairs = [("zero3", "zero3"), ("fsdp", "fsdp2"), ("zero2", "plain"), ("fsdp2", "zero3")]
    check_copies(gpu_group.run(sc.copy_pairs, pairs, 0.25, "cuda", timeout=300), tol=1e-4)


def check_copies(results: list[dict[str, Any]], tol: float = 1e-5) -> None:
    for rank, per_pair in enumerate(results):
        for pair, obs in per_pair.items():
            where = f"rank {rank}, {pair}"
            assert obs["ema_changed"], f"{where}: EMA left the target as it was"
            assert obs["ema_max_diff"] < 1e-6, f"{where}: EMA off by {obs['ema_max_diff']}"
            assert obs["ema_forward"] < tol, f"{where}: shards used by forward lack the EMA update"
            assert obs["source_unchanged"], f"{where}: copy_to changed the source"
            assert obs["copy_bitwise"], f"{where}: alpha=1 is not an exact copy"
            assert obs["copy_forward"] < tol, f"{where}: shards used by forward lack the copy"
            assert obs["flags_kept"], f"{where}: training or requires_grad flags changed"
            assert obs["frozen"] in (None, True), f"{where}: frozen target unfrozen"
            # Same sharded layout on both sides: synced shard to shard, nothing gathered.
            src_backend, dst_backend = pair.split("->")
            same_shards = src_backend == dst_backend and src_backend in ("zero3", "fsdp2", "tp", "fsdp2+tp")
            assert obs["shard_to_shard"] == same_shards, where


def test_zero_master_weights_refreshed(group: Any) -> None:
    for stage in ("zero1", "zero2", "zero3"):
        results = group.run(sc.step_after_write, stage, timeout=180)
        for rank, obs in enumerate(results):
            assert obs["max_rel_diff"] < 1e-4, f"{stage} rank {rank}: the optimizer step undid the load"


def test_fsdp1_flat_parameters_and_tied_weights(group: Any) -> None:
    for rank, obs in enumerate(group.run(sc.variants, timeout=240)):
        for key, value in obs.items():
            if key.endswith("_forward"):
                assert value < 1e-5, f"rank {rank}: {key} = {value}"
            else:
                assert value is True, f"rank {rank}: {key} failed"


@pytest.mark.parametrize("spec", ["plain", "zero3", "fsdp", "fsdp2", "tp"])
def test_strict_errors_leave_model_unchanged(group: Any, shared_dir: str, spec: str) -> None:
    for rank, obs in enumerate(group.run(sc.strict_errors, spec, shared_dir, timeout=240)):
        msg = obs["strict"]
        assert msg.startswith("StateDictError"), msg
        assert "missing key" in msg and "unexpected key 'model.not_a_layer.weight'" in msg and "[7, 7]" in msg
        assert "3 problem(s)" in msg
        assert obs["unchanged_strict"], f"rank {rank}: strict load wrote before failing"
        if spec != "plain":
            assert obs["one_rank"].startswith("StateDictError"), obs["one_rank"]
            if rank == 1:
                assert "missing key" in obs["one_rank"]
            assert obs["unchanged_one_rank"]
        assert obs["lenient_loaded"] and obs["lenient_kept_missing"]
        for kind in ("trunc", "garbage", "missing"):
            assert obs[f"file_{kind}"].startswith("StateDictError"), f"{kind}: {obs[f'file_{kind}']}"
        assert "truncated or corrupt" in obs["file_trunc"] and "no checkpoint file" in obs["file_missing"]
        assert obs["unchanged_files"] and obs["flags_kept"]
        assert obs["copy_mismatch"].startswith("StateDictError") and "model.layers.2" in obs["copy_mismatch"]
        assert obs["copy_target_unchanged"]
        assert obs["bad_alpha"].startswith("ArgumentError") and "alpha=1.5" in obs["bad_alpha"], obs["bad_alpha"]
        assert obs["save_bad_dir"].startswith("StateDictError") and "does not exist" in obs["save_bad_dir"]


def test_peft_merge_export() -> None:
    ref = sc.peft_reference()
    obs = sc.peft_export("peft")
    assert sc._bitwise(obs["held"], ref["held"]), "default export is not what the PEFT model holds"
    assert sc._bitwise(obs["merged"], ref["merged"]), "merged export differs from PEFT's merge_and_unload()"
    assert obs["unchanged"] and obs["forward_unchanged"] and not obs["any_merged_flag"]
    # The merge is not a no-op: LoRA B was made non-zero.
    key = "model.layers.0.self_attn.q_proj.weight"
    held_key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert not torch.equal(ref["merged"][key], ref["held"][held_key])


def test_peft_merge_refuses_what_it_cannot_fold(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from wrapkit.cli._models import tiny_llama

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    wm = wrapkit.adapt(model)
    # Every merged export refuses it alike: its own cause and fix, no other error's hint, nothing written.
    directory = tmp_path / "merged"
    for export in (lambda: wm.full_state_dict(merge_adapters=True),
                   lambda: list(wm.stream_full_parameters(merge_adapters=True)),
                   lambda: wm.save_pretrained(directory, merge_adapters=True)):
        with pytest.raises(wrapkit.UnsupportedModelError, match="DoRA") as info:
            export()
        assert "merge_adapters=False" in str(info.value) and "Pass a directory" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
    # Without PEFT there is nothing to merge: the plain export.
    plain = wrapkit.adapt(tiny_llama())
    assert sc._bitwise(plain.full_state_dict(merge_adapters=True), plain.full_state_dict())


@pytest.mark.parametrize("spec", ["zero3>peft", "fsdp2>peft"])
def test_peft_merge_export_sharded(group: Any, spec: str) -> None:
    ref = sc.peft_reference()
    for obs in group.run(sc.peft_export, spec, timeout=180):
        assert sc._bitwise(obs["held"], ref["held"])
        assert sc._bitwise(obs["merged"], ref["merged"])
        assert obs["unchanged"] and obs["forward_unchanged"] and not obs["any_merged_flag"]


def test_save_is_atomic_under_kill(tmp_path: Path) -> None:
    """Kill a process while it writes: the earlier file at ``path`` survives intact."""
    path = tmp_path / "model.safetensors"
    early = torch.nn.Linear(4, 4)
    wrapkit.adapt(early).save(path)
    earlier_bytes = path.read_bytes()
    numel = 32 * 2**20  # 128 MiB of float32: the write takes long enough to be caught
    code = f"from tests.exchange.scenarios_state import save_big; save_big({str(path)!r}, {numel})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    seen = ""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = [p for p in os.listdir(tmp_path) if p.startswith(".model.safetensors.") and p.endswith(".tmp")]
            if tmps:
                os.kill(proc.pid, signal.SIGKILL)
                seen = tmps[0]
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert seen, "the saving process never wrote a temporary file next to the target"
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == earlier_bytes, "killing save() harmed the earlier file"
    sd = wrapkit.read_checkpoint(path)
    assert torch.equal(sd["weight"], early.weight.detach())
    # What was left behind is the temporary file only, and a later save replaces the file.
    assert (tmp_path / seen).stat().st_size < numel * 4
    wrapkit.adapt(torch.nn.Linear(4, 2)).save(path)
    assert wrapkit.read_checkpoint(path)["weight"].shape == (2, 4)


def test_saved_files_get_the_usual_permissions_and_read_back_in_every_dtype(tmp_path: Path) -> None:
    """save and save_pretrained write through one writer: files get the mode any new file gets (the
    umask applied, not safetensors' owner-only), and safetensors itself reads back every dtype bit for bit."""
    from safetensors.torch import load_file

    model = torch.nn.Module()
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]):
        values = torch.randn(3, 5).to(dtype) if dtype.is_floating_point else torch.arange(15).reshape(3, 5)
        model.register_buffer(f"b{i}", values)
    old = os.umask(0o022)
    try:
        wm = wrapkit.adapt(model)
        wm.save(tmp_path / "one.safetensors")
        wm.save_pretrained(tmp_path / "dir")
    finally:
        os.umask(old)
    files = [tmp_path / "one.safetensors", *sorted((tmp_path / "dir").glob("*.safetensors"))]
    for file in files:
        assert file.stat().st_mode & 0o777 == 0o644, file
        back = load_file(file)
        for name, t in model.state_dict().items():
            assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8))


def test_save_plain_tied_weights_and_buffers(tmp_path: Path) -> None:
    """Tied parameters and persistent buffers are exported under every state_dict() key."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.tensor([2.0]))
            self.register_buffer("cache", torch.ones(3), persistent=False)

    model = Tied()
    wm = wrapkit.adapt(model)
    sd = wm.full_state_dict()
    assert list(sd) == list(model.state_dict())
    path = tmp_path / "tied.safetensors"
    wm.save(path)
    other = Tied()
    other.load_state_dict(wrapkit.read_checkpoint(path))
    assert torch.equal(other.head.weight, model.emb.weight) and other.head.weight is other.emb.weight
    with torch.no_grad():
        model.scale.fill_(5.0)
    wrapkit.adapt(other).load(path)
    assert float(other.scale) == 2.0
    wm.copy_to(wrapkit.adapt(other))
    assert float(other.scale) == 5.0
    with pytest.raises(wrapkit.UnsupportedModelError, match="WrappedModel") as info:
        wm.copy_to(other)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("spec", ["zero3", "fsdp2"])
def test_sync_into_a_reference_that_ran_forwards(group: Any, spec: str) -> None:
    for obs in group.run(sc.sync_after_forwards, spec, timeout=180):
        assert obs["fast"], "same-layout pair did not sync shard to shard"
        assert obs["exact"] < 1e-5, f"the reference computes with stale weights ({obs['exact']})"
        assert obs["after_ema"] < 1e-5
        assert obs["into_trained"] < 1e-5, f"a trained target computes with stale weights ({obs['into_trained']})"


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_copy_to_caches_the_pairing(group: Any, backend: str) -> None:
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    for rank, obs in enumerate(group.run(sc.cached_sync, backend, timeout=120)):
        where = f"rank {rank}, {backend}: {obs}"
        # The first sync validates (one all-reduce); later ones keep only that entry, or none unchecked.
        assert obs["first"] == 1 and obs["checked"] == 1 and obs["unchecked"] == 0, where
        assert obs["unchecked_exact"], where
        # Shards moved to fresh storage: the pairing is read again and the live shards are written.
        assert obs["after_move"] >= 1 and obs["after_move_exact"], where
        assert obs["new_target_exact"], where


def test_zero3_writes_wait_for_every_gather(group: Any) -> None:
    """DeepSpeed before 0.19 waited for the last of its all-gathers only (the oldest-versions environment)."""
    pytest.importorskip("deepspeed")
    for rank, obs in enumerate(group.run(sc.zero3_writes_after_slow_gathers, timeout=180)):
        assert not any(obs["lost"]), f"rank {rank}: loaded values lost, per round: {obs['lost']}"


def test_a_lenient_load_returns_and_logs_what_it_left_out(tmp_path: Any, caplog: Any) -> None:
    """strict=False: the keys the checkpoint lacks keep their values, its keys the model lacks are not read,
    and both come back as LoadResult (and in one warning), from load and load_full_state_dict alike."""
    import logging

    from safetensors.torch import load_file, save_file

    import wrapkit
    from wrapkit.cli._models import tiny_llama

    source = tiny_llama(1).state_dict()
    sd = {k: v for k, v in source.items() if "layers.1." not in k}
    sd["extra.weight"] = torch.ones(3)
    save_file(sd, tmp_path / "partial.safetensors")
    for how in ("load", "load_full_state_dict"):
        model = tiny_llama(2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        wm = wrapkit.adapt(model)
        with caplog.at_level(logging.WARNING, logger="wrapkit"):
            caplog.clear()
            if how == "load":
                result = wm.load(tmp_path / "partial.safetensors", strict=False)
            else:
                result = wm.load_full_state_dict(load_file(tmp_path / "partial.safetensors"), strict=False)
        skipped = [k for k in source if "layers.1." in k]
        assert isinstance(result, wrapkit.LoadResult)
        assert result.missing_keys == skipped and result.unexpected_keys == ["extra.weight"], result
        after = model.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in skipped)
        assert all(torch.equal(after[k], source[k]) for k in source if k not in skipped)
        [record] = [r for r in caplog.records if "strict=False" in r.getMessage()]
        assert f"left out {len(skipped)} key(s)" in record.getMessage() and "extra.weight" in record.getMessage()
        # A strict load of a complete checkpoint reports nothing left out.
        assert wm.load_full_state_dict(source) == wrapkit.LoadResult([], [])
