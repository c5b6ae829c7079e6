"""ms-swift's own DPO and GRPO pipelines on two CPU ranks with wrapkit's drop-ins patched in
(``tests/integrations/swift_run.py`` under torchrun: one launch per backend runs both), and ``patch_swift`` itself.

ms-swift pins its own transformers, TRL and PEFT, so these tests run in an environment of their
own; ``.ci/run`` builds it. By hand::

    python3 -m venv .venv-swift && . .venv-swift/bin/activate && pip install torch==2.13.0 uv \\
        && uv pip install -e ".[swift]" pytest pytest-timeout && python -m pytest tests/integrations/test_swift.py
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "swift.pipelines", reason="ms-swift is not installed here (it needs an environment of its own: see "
    "tests/integrations/test_swift.py's docstring, or run .ci/run, which builds one)")

from tests.harness.launch import ROOT, torchrun  # noqa: E402
from tests.integrations.swift_run import save_tiny, write_rows  # noqa: E402

SCRIPT = ROOT / "tests" / "integrations" / "swift_run.py"
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("swift-tiny")
    save_tiny(root / "model")
    write_rows(root / "rows.jsonl")
    return root / "model", root / "rows.jsonl"


@pytest.fixture(scope="module")
def runs(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """``runs(backend)``: what each rank saw in DPO and in GRPO, from one launch per backend (made
    when first asked for): a launch that imports ms-swift costs more than a three-step pipeline."""
    model, rows = tiny
    done: dict[str, dict[str, Any]] = {}

    def get(backend: str) -> dict[str, Any]:
        if backend not in done:
            summary = tmp_path_factory.mktemp(f"swift-{backend}") / "summary.json"
            torchrun(SCRIPT, "--trainer", "dpo", "grpo", "--backend", backend, "--model", str(model),
                     "--data", str(rows), "--json", str(summary), "--steps", str(STEPS), timeout=400,
                     DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
            ranks = json.loads(summary.read_text())
            done[backend] = {kind: [rank[kind] for rank in ranks] for kind in ranks[0]}
        return done[backend]

    return get


def test_patch_swift_swaps_and_undoes() -> None:
    import swift.rlhf_trainers.utils as rlhf_utils
    import swift.utils
    import swift.utils.transformers_utils as tf_utils
    import trl.models.utils as trl_utils

    from wrapkit.integrations import swift as dropins
    from wrapkit.integrations import trl as trl_dropins

    sources = [(tf_utils, "unwrap_model_for_generation"), (swift.utils, "unwrap_model_for_generation"),
               (rlhf_utils, "prepare_deepspeed"), (rlhf_utils, "prepare_fsdp")]
    originals = {(m.__name__, n): getattr(m, n) for m, n in sources}
    trl_original = trl_utils.prepare_deepspeed
    from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin as Mixin

    syncs = {n: Mixin.__dict__[n]
             for n in ("_move_full_model_to_vllm", "_move_adapter_to_vllm", "_prepare_vllm_engine")}
    with dropins.patch_swift() as patch:
        # GRPO's weight sync to vLLM takes its tensors from wrapkit.
        assert Mixin._move_full_model_to_vllm is dropins.move_full_model_to_vllm
        assert Mixin._move_adapter_to_vllm is dropins.move_adapter_to_vllm
        # Colocate mode's engine is built reloadable on vLLM's CPU build.
        assert Mixin._prepare_vllm_engine is dropins.prepare_vllm_engine
        # (TRL's trainers' methods, which patch_trl() replaced underneath, are listed too.)
        assert {(c, n) for c, n, _ in patch.methods if c is Mixin} == {(Mixin, n) for n in syncs}
        assert dropins.patch_swift().methods == []
        for module, name in sources:
            assert getattr(module, name) is getattr(dropins, name), f"{module.__name__}.{name} not patched"
        assert trl_utils.prepare_deepspeed is trl_dropins.prepare_deepspeed  # TRL's, which ms-swift imports
        assert {f"{m.__name__}.{n}" for m, n, _ in patch.swaps} >= {
            "swift.utils.unwrap_model_for_generation", "swift.rlhf_trainers.utils.prepare_deepspeed"}
        assert dropins.patch_swift().swaps == []  # patching again changes nothing
    for module, name in sources:
        assert getattr(module, name) is originals[(module.__name__, name)], f"{module.__name__}.{name} not restored"
    assert trl_utils.prepare_deepspeed is trl_original
    assert all(Mixin.__dict__[n] is f for n, f in syncs.items()), "GRPO's weight sync not restored"


def test_prepare_deepspeed_refuses_none() -> None:
    import wrapkit
    from wrapkit.integrations.swift import prepare_deepspeed

    with pytest.raises(wrapkit.ReferenceModelError, match="prepare_reference"):
        prepare_deepspeed(None, accelerator=None)  # type: ignore[arg-type]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("backend", "ref_backend"), [("zero3", "deepspeed"), ("fsdp2", "fsdp2")])
def test_swift_dpo_run(runs: Callable[[str], dict[str, Any]], backend: str, ref_backend: str) -> None:
    for obs in runs(backend)["dpo"]:
        print(f"{backend}: losses {obs['losses']}; generation {obs['generation']}")
        assert obs["error"] is None
        assert all(obs["sees_wrapkit"].values()), obs["sees_wrapkit"]
        losses = obs["losses"]
        assert len(losses) == STEPS
        # The reference starts as the policy: the first DPO loss is ln 2; then the policy learns.
        assert abs(losses[0] - math.log(2)) < 1e-4 and len(set(losses)) > 1 and losses[-1] < losses[0]
        # Failure #4 inside ms-swift: every module trains at every backward.
        assert obs["modes"] and all(obs["modes"])
        # The reference is sharded like the policy, frozen in eval mode.
        assert obs["policy_backend"] == ref_backend and obs["policy_sharded"]
        assert obs["ref_backend"] == ref_backend and obs["ref_sharded"] and obs["ref_eval"]
        # Generation between steps, the way ms-swift's inference engine does it (model.eval() inside):
        ours, theirs = obs["generation"]["wrapkit"], obs["generation"]["ms-swift"]
        assert ours["generated"] == theirs["generated"] == 4
        assert ours["eval_after_generation"] == 0 and ours["modes_at_next_backward"] == [True]
        # ms-swift's own helper, on the same run, leaves every module in eval mode for the next backward.
        assert theirs["eval_after_generation"] == theirs["modules"] and theirs["modes_at_next_backward"] == [False]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("backend", "ref_backend"), [("zero3", "deepspeed"), ("fsdp2", "fsdp2")])
def test_swift_grpo_run(runs: Callable[[str], dict[str, Any]], backend: str, ref_backend: str) -> None:
    """GRPO generates with ms-swift's inference engine between steps, through the patched
    ``unwrap_model_for_generation``: every module trains at every loss that follows. It runs after
    DPO in the same processes, so it also shows that one pipeline leaves nothing behind for the next."""
    for obs in runs(backend)["grpo"]:
        print(f"{backend} GRPO: losses {obs['losses']}; rewards {obs['rewards']}")
        assert obs["error"] is None
        assert all(obs["sees_wrapkit"].values()), obs["sees_wrapkit"]
        assert len(obs["losses"]) == STEPS and len(set(obs["rewards"])) > 1
        assert len(obs["modes"]) >= STEPS and all(obs["modes"])
        assert obs["policy_backend"] == ref_backend and obs["ref_backend"] == ref_backend
        assert obs["ref_sharded"] and obs["ref_eval"]


SYNC_CASES = [{"family": "llama"}, {"family": "qwen2-tied"}, {"family": "qwen3-moe"},
              {"family": "llama", "peft": "lora"}, {"family": "llama", "peft": "lora-mts"},
              {"family": "llama", "peft": "lora", "served_lora": True}, {"family": "qwen2-vl"},
              # The accelerator lists no wrapper: the sync reads the trainer's module, which wrapkit reads through
              # the engine it finds (ZeRO-3) or as the whole replica it is (DDP, FSDP2).
              {"family": "qwen3-moe", "peft": "lora", "unlisted": True}]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "zero3"])
def test_swift_grpo_weight_sync(group: Any, kind: str) -> None:
    """ms-swift's own ``_move_model_to_vllm`` after ``patch_swift()`` (ms-swift refuses FSDP1 for GRPO): in server
    and colocate mode, a sync before any forward and another after a training step send exactly the Hub's tensors
    (LoRA merged, or the base weights once and then the adapter alone where the rollout serves it), and leave the
    trained weights bit-identical."""
    from tests.integrations import scenarios_swift_sync as sc

    for rank_obs in group.run(sc.swift_sync, kind, SYNC_CASES, timeout=400):
        for o in rank_obs:
            assert len(o["syncs"]) == 2
            for sync in o["syncs"]:
                what = (o["family"], o.get("peft"), o.get("served_lora"), o.get("unlisted"))
                assert sync["live_changed"] == [], (what, "a sync moved the trained weights")
                for mode in ("server", "colocate") if o["rank"] == 0 else ("colocate",):
                    assert sync[mode] == [], (what, mode, sync[mode][:3])
                    assert sync.get(mode + "_adapter", []) == [], (what, mode, sync[mode + "_adapter"][:3])
