"""The adapter-disabled reference of a PEFT policy (``prepare_reference(policy, None)``): every
operation sees the base model with the adapters off, under the base model's names, on every
backend; what would write or move the policy's weights is refused with ReferenceModelError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.references import scenarios_view as sc

SPECS = ["peft", "ddp>peft", "zero2>peft", "zero3>peft", "fsdp>peft", "fsdp2>peft"]


@pytest.mark.parametrize("spec", SPECS)
def test_view_sees_the_base_model(request: pytest.FixtureRequest, spec: str, tmp_path: Path) -> None:
    if spec == "peft":
        results = [sc.view_operations(spec, str(tmp_path))]
    else:
        group: Any = request.getfixturevalue("group")
        results = group.run(sc.view_operations, spec, str(tmp_path), timeout=240)
    for obs in results:
        assert obs["type"] == "AdapterDisabledView" and obs["stack"][0] == "adapters-off"
        assert obs["is_protocol"] and obs["adapt_is_same"]
        # The policy trained away from the base model; the view still computes the base model.
        assert obs["policy_differs"] > 1e-2
        assert obs["forward"] < 1e-5
        assert obs["gathered_logits"] < 1e-5 and obs["generation_logits"] < 1e-5
        assert obs["generation_tokens"], f"{spec}: greedy tokens differ from the base model's"
        # generation() puts the policy in eval mode and gives back its modes and flags.
        assert obs["policy_training_inside"] == 0
        assert obs["modes_restored"] and obs["requires_grad_restored"] and obs["requires_grad_final"]
        assert obs["named_full_names"] and obs["named_full_diff"] == 0.0
        if "state_keys" in obs:  # rank 0
            assert obs["state_keys"] and obs["lora_keys"] == [] and obs["state_diff"] == 0.0
        assert obs["merge_same"] and obs["num_parameters"]
        assert obs["saved_diff"] == 0.0
        assert obs["copy_diff"] == 0.0 and obs["ema_diff"] < 1e-6
        assert "adapters off" in obs["describe"] and "owns no parameters" in obs["describe"]
        refused = obs["refused"]
        for op in ("load_full_state_dict", "load", "copy_into", "gathered_modifier", "place_elsewhere", "as_policy"):
            assert refused[op].startswith("ReferenceModelError: "), f"{op}: {refused[op]}"
        assert "the policy this reference is a view of" in refused["copy_into_policy"]
        assert refused["copy_to_dict"].startswith("UnsupportedModelError: ")
        assert obs["place_home"]
        assert obs["policy_unchanged"] == 0.0


def test_view_of_a_merged_policy_is_refused() -> None:
    obs = sc.merged_policy_refused()
    for op, msg in obs["errors"].items():
        assert msg.startswith("ReferenceModelError: the policy's adapters are merged"), f"{op}: {msg}"
        assert "unmerge_adapter()" in msg
    assert obs["unchanged"], "the refused calls unmerged the policy's weights"
    assert obs["works_again"]


def test_view_adapter_takes_nothing_from_the_unsharded_defaults() -> None:
    """Every public member of ``Adapter`` is the view's own, forwarded to the policy or refused: none
    is the base class's unsharded default, which would be a silent wrong answer over a sharded policy."""
    import inspect

    from wrapkit.adapters import Adapter
    from wrapkit.references.view import AdaptersOff

    inherited = [name for name in dir(Adapter) if not name.startswith("_")
                 and not isinstance(inspect.getattr_static(Adapter, name), classmethod)
                 and name not in vars(AdaptersOff)]
    assert inherited == []


# What writes, moves or copies a model's weights: the view must refuse each.
WRITES = {"frozen_form", "parts"}
# What the view defines itself: renamed reads, gathers with the adapters off, its counts and summary.
OWN = {"name", "stack", "named_live", "merge_root", "num_parameters", "resident_parameter_bytes", "describe"}


def test_the_view_forwards_reads_only_and_refuses_the_rest() -> None:
    """Refusal is the default: a member of ``Adapter`` is forwarded to the policy only if it is named as a read,
    none of the reads writes, and every other member (a write, or one added later) raises."""
    import inspect

    import wrapkit
    from tests.exchange.scenarios_peft import lora_model
    from wrapkit import ReferenceModelError
    from wrapkit._registry import as_adapter
    from wrapkit.adapters import Adapter
    from wrapkit.references.view import READS, AdaptersOff

    assert not READS & WRITES and not OWN & WRITES
    view = AdaptersOff(as_adapter(wrapkit.adapt(lora_model(1))))
    members = {name for name in dir(Adapter) if not name.startswith("_")
               and not isinstance(inspect.getattr_static(Adapter, name), classmethod)}
    refused = set()
    for name in sorted(members - READS - OWN):
        with pytest.raises(ReferenceModelError):
            value = getattr(view, name)
            value()  # a method: refused when called
        refused.add(name)
    assert WRITES <= refused, WRITES - refused
    for name in sorted(READS):  # forwarded: the policy's own value
        value = getattr(view, name)
        assert value == getattr(view.policy, name) or callable(value), name
    # It has no likeness and no states: a copy or a sleep would act on the policy's weights.
    assert view.likeness is None and view.states is None
    assert view.policy.likeness is not None and view.policy.states is not None
    # Its parts read the policy's weights under the base model's names; each member that would write or move
    # them refuses.
    from wrapkit.adapters import Written

    names = set(view.weights.param_shapes())
    assert names and not any("lora_" in n or "base_layer" in n for n in names)
    assert len(names) < len(view.policy.weights.param_shapes())
    for write in (view.weights.pieces, lambda: view.weights.written(Written.WEIGHTS),
                  lambda: view.placement.move(torch.device("cpu"), False), view.placement.frozen_parameters,
                  lambda: view.gatherer.full(0).__enter__()):
        with pytest.raises(ReferenceModelError):
            write()
