"""TRL's own trainers, run for a few steps on two CPU ranks with wrapkit's drop-ins patched in
(``tests/integrations/trl_run.py`` under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from tests.harness.launch import ROOT, torchrun  # noqa: E402
from tests.integrations.trl_run import LAYERS, save_tiny  # noqa: E402

SCRIPT = ROOT / "tests" / "integrations" / "trl_run.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path)
    return path


def _launch(trainer: str, backend: str, model: Path, out: Path) -> list[dict[str, Any]]:
    summary = out / "summary.json"
    torchrun(SCRIPT, "--trainer", trainer, "--backend", backend, "--model", str(model), "--json", str(summary),
             HF_HUB_OFFLINE="1")
    result: list[dict[str, Any]] = json.loads(summary.read_text())
    return result


def test_patch_trl_swaps_and_undoes() -> None:
    import trl.models
    import trl.models.utils as utils
    from trl.generation.vllm_generation import VLLMGeneration

    from wrapkit.integrations import trl as dropins

    names = ("prepare_deepspeed", "prepare_fsdp", "unwrap_model_for_generation")
    originals = {n: getattr(utils, n) for n in names}
    # TRL releases before the walk (0.29: its sync_weights pushes tensors itself) keep their own sync.
    walk = VLLMGeneration.__dict__.get("_iter_named_params")
    from wrapkit.integrations._trl_async import async_methods
    from wrapkit.integrations._trl_online_dpo import online_dpo_methods

    # TRL's async trainers (1.x) sync on wrapkit's stream where their transfer is wrapkit's; online DPO's
    # constructor and sync are wrapkit's where this TRL has the trainer.
    asynchronous = [(c, n) for c, n, _ in async_methods()]
    online = [(c, n) for c, n, _ in online_dpo_methods(1.0, False)]
    online_own = {n: c.__dict__[n] for c, n in online}
    with dropins.patch_trl() as patch:
        # The weight sync of GRPO, RLOO and distillation takes its tensors from wrapkit.
        own = [(VLLMGeneration, n) for n in ("_iter_named_params", "_init_vllm", "sync_weights")]
        assert [(c, n) for c, n, _ in patch.methods] == (own if walk else []) + asynchronous + online
        assert VLLMGeneration.__dict__.get("_iter_named_params") is not walk or walk is None
        assert all(getattr(utils, n) is getattr(dropins, n) for n in names)
        assert all(getattr(trl.models, n) is getattr(dropins, n) for n in names)
        assert all(m.__name__.startswith("trl") for m, _, _ in patch.swaps)
        assert dropins.patch_trl().swaps == []  # patching again changes nothing
    # Undone everywhere, also where the drop-ins were picked up during the patch (trl.models
    # resolves its attributes lazily, and cached ours above).
    assert all(getattr(utils, n) is originals[n] for n in names)
    assert all(getattr(trl.models, n) is originals[n] for n in names)
    assert VLLMGeneration.__dict__.get("_iter_named_params") is walk
    assert all(c.__dict__["_sync_weight_merged"].__module__.startswith("trl") for c, _ in asynchronous)
    assert all(c.__dict__[n] is online_own[n] for c, n in online)
    if walk is not None:  # server mode on wrapkit's engine: asked for by any patch_trl() call, undone alike
        own = {n: VLLMGeneration.__dict__[n] for n in ("_init_vllm", "sync_weights")}
        with dropins.patch_trl() as patch:
            assert not VLLMGeneration._init_vllm.wrapkit_server.server
            with dropins.patch_trl(vllm_server=True, sync_timeout=7.0) as again:
                assert again.methods == []  # nothing more replaced: the installed methods are told
                assert VLLMGeneration._init_vllm.wrapkit_server.server
                assert VLLMGeneration._init_vllm.wrapkit_server.timeout == 7.0
                for owner, _ in online[1:]:
                    assert owner._move_model_to_vllm.wrapkit_online_dpo.server
                    assert owner._move_model_to_vllm.wrapkit_online_dpo.timeout == 7.0
        assert all(VLLMGeneration.__dict__[n] is f for n, f in own.items())


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "distributed_type", "ref_backend"), [
    ("zero3", "DEEPSPEED", "deepspeed"),
    ("fsdp", "FSDP", "fsdp"),
    ("fsdp2", "FSDP", "fsdp2"),
])
def test_dpo_trainer(tiny_model: Path, tmp_path: Path, backend: str, distributed_type: str, ref_backend: str) -> None:
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in _launch("dpo", backend, tiny_model, tmp_path):
        assert "trl.models.utils.prepare_deepspeed" in obs["patched"]
        assert obs["trainer_sees"] == ["prepare_deepspeed", "prepare_fsdp"]
        assert obs["distributed_type"] == distributed_type and obs["policy_backend"] == ref_backend
        # The reference TRL's DPOTrainer holds is the one wrapkit prepared: in eval mode, sharded
        # over the two ranks, per block under FSDP (TRL's own FSDP2 path shards the root only).
        assert obs["ref_backend"] == ref_backend and obs["ref_eval"]
        if backend == "fsdp":
            # FSDP1 keeps its root unit (embeddings, head) gathered after a forward without
            # backward, next to the root's shard; TRL's fused LM head needs the head in the root,
            # so only the blocks stay sharded.
            expected = 1.5 * obs["outside_blocks"] + (1 - obs["outside_blocks"]) / 2
        else:
            expected = 0.5
        assert abs(obs["ref_resident"] - expected) < 0.01, (obs["ref_resident"], expected)
        if backend.startswith("fsdp"):
            assert obs["ref_blocks_sharded"] == LAYERS
        # At step 0 the policy equals the reference, so the DPO loss is exactly ln 2: the
        # reference holds the right weights. Training then lowers it.
        losses = obs["losses"]
        assert len(losses) == 3 and abs(losses[0] - obs["ln2"]) < 1e-4, losses
        assert losses[-1] < losses[0]
        assert obs["train_modes"] == [True] * 3


@pytest.mark.long
@pytest.mark.timeout(300)
def test_dpo_trainer_precomputed_reference(tiny_model: Path, tmp_path: Path) -> None:
    """Without a reference model DPOTrainer passes the policy itself through prepare_deepspeed to
    precompute reference log-probs; the drop-in must leave it trainable."""
    pytest.importorskip("deepspeed")
    for obs in _launch("dpo-precompute", "zero3", tiny_model, tmp_path):
        assert obs["policy_backend"] == "deepspeed" and obs["policy_trainable"] > 0
        losses = obs["losses"]
        assert len(losses) == 3 and abs(losses[0] - obs["ln2"]) < 1e-4, losses
        assert losses[-1] < losses[0] and obs["train_modes"] == [True] * 3


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "policy_backend"), [("zero3", "deepspeed"), ("fsdp2", "fsdp2")])
def test_grpo_trainer(tiny_model: Path, tmp_path: Path, backend: str, policy_backend: str) -> None:
    """GRPO generates every step through ``unwrap_model_for_generation`` and scores against the
    reference from ``prepare_deepspeed``/``prepare_fsdp``."""
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    for obs in _launch("grpo", backend, tiny_model, tmp_path):
        assert obs["trainer_sees"] == ["prepare_deepspeed", "prepare_fsdp", "unwrap_model_for_generation"]
        assert obs["policy_backend"] == policy_backend and obs["ref_eval"]
        # Generation ran right before every loss, and the policy was back in training mode each time.
        assert obs["train_modes"] == [True] * 3
        assert len(obs["rewards"]) == 3
        # KL to the reference: exactly 0 while the policy still equals it, then positive as it learns.
        kl = obs["kl"]
        assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-6, kl
