"""save_state / load_state when things go wrong (``scenarios_state_failures``), on every backend that resumes:
a save failing partway on one rank, damaged, cut and foreign checkpoints, optimizers inside containers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.training import scenarios_state_failures as sc

SPECS = ["ddp", "fsdp", "fsdp2", "tp", "zero1", "zero2", "zero3"]


def test_a_failed_save_or_load_raises_a_typed_error_and_leaves_nothing(group: Any, tmp_path: Path) -> None:
    """torch's checkpoint raises ``CheckpointException``, a ``BaseException``: it passes ``except Exception``. A save
    whose files rank 1 cannot write, a data file damaged in place and the optimizer's param groups cut out of the
    metadata each raise a typed error on every rank, the cause chained; the failed save leaves its temporary
    directory nowhere and the previous checkpoint as it was; the next save loads exactly. A checkpoint torch wrote
    for another tool is named as such."""
    for rank, per_spec in enumerate(group.run(sc.each, str(tmp_path), SPECS, "failures", timeout=600)):
        for spec, obs in per_spec.items():
            where = f"rank {rank}, {spec}"
            failed = obs["failed_save"]
            assert failed["typed"] and failed["type"] == "StateDictError", (where, failed)
            assert failed["cause"] is not None and "could not write" in failed["message"], (where, failed)
            assert obs["left_behind"] == [], (where, obs["left_behind"])
            assert obs["previous_untouched"] and obs["reloaded_exactly"], (where, obs)
            damaged = obs["damaged"]
            assert damaged["typed"] and damaged["cause"] == "CheckpointException", (where, damaged)
            assert "failed while reading" in damaged["message"], (where, damaged)
            if "cut" in obs:
                cut = obs["cut"]
                assert cut["typed"] and "optim/param_groups" in cut["message"], (where, cut)
                assert "nothing was written" in cut["message"], (where, cut)
            foreign = obs["foreign"]
            assert foreign["typed"] and "torch distributed checkpoint (DCP) that another tool wrote" in foreign[
                "message"], (where, foreign)
            assert "not a complete save_state directory" not in foreign["message"], (where, foreign)


def test_optimizers_inside_containers_are_saved_with_their_state(group: Any, tmp_path: Path) -> None:
    """A container of optimizers (torchtitan's kind: a torch ``Optimizer`` whose own state stays empty) is saved as
    the optimizers inside it: every moment, loaded back exactly. An optimizer over another model is refused at save,
    nothing written."""
    for rank, per_spec in enumerate(group.run(sc.each, str(tmp_path), SPECS, "containers", timeout=600)):
        for spec, obs in per_spec.items():
            where = f"rank {rank}, {spec}"
            if spec.startswith("zero"):
                assert obs["saved_through_container"], (where, obs)
                continue
            assert obs["state_keys"] > 0, (where, obs)
            if "bare_state_keys" in obs:
                assert obs["state_keys"] == obs["bare_state_keys"], (where, obs)
            assert obs["moments_restored"] and obs["weights_restored"], (where, obs)
            elsewhere = obs["elsewhere"]
            assert elsewhere["typed"] and "steps none of this model's parameters" in elsewhere["message"], (
                where, elsewhere)
            assert not obs["elsewhere_written"], where
