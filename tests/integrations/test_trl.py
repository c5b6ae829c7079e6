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

    # TRL's async trainers (1.x) sync on wrapkit's stream where their transfer is wrapkit's.
    asynchronous = [(c, n) for c, n, _ in async_methods()]
    with dropins.patch_trl() as patch:
        # The weight sync of GRPO, RLOO and distillation takes its tensors from wrapkit.
        own = [(VLLMGeneration, n) for n in ("_iter_named_params", "_init_vllm", "sync_weights")]
        assert [(c, n) for c, n, _ in patch.methods] == (own if walk else []) + asynchronous
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
    if walk is not None:  # server mode on wrapkit's engine: asked for by any patch_trl() call, undone alike
        own = {n: VLLMGeneration.__dict__[n] for n in ("_init_vllm", "sync_weights")}
        with dropins.patch_trl() as patch:
            assert not VLLMGeneration._init_vllm.wrapkit_server.server
            with dropins.patch_trl(vllm_server=True, sync_timeout=7.0) as again:
                assert again.methods == []  # nothing more replaced: the installed methods are told
                assert VLLMGeneration._init_vllm.wrapkit_server.server
                assert VLLMGeneration._init_vllm.wrapkit_server.timeout == 7.0
        assert all(VLLMGeneration.__dict__[n] is f for n, f in own.items())
