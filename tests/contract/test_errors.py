"""Bad input: each gets a typed error naming the object's type and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import wrapkit
from tests.harness import scenarios
from wrapkit.cli._models import tiny_llama, toy_model


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (None, "prepare_reference"),
        ({"weight": torch.zeros(1)}, "dict"),
        (torch.zeros(3), "Tensor"),
        ("meta-llama/Llama-3-8B", "str"),
        (42, "int"),
    ],
)
def test_non_modules_are_refused(bad: Any, needle: str) -> None:
    with pytest.raises(wrapkit.UnsupportedModelError) as info:
        wrapkit.adapt(bad)
    assert needle in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, wrapkit.WrapkitError)


class HomeMadeWrapper(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def test_unknown_wrapper_is_not_peeled_by_guessing() -> None:
    with pytest.raises(wrapkit.UnsupportedModelError) as info:
        wrapkit.adapt(HomeMadeWrapper(tiny_llama()))
    msg = str(info.value)
    assert "HomeMadeWrapper" in msg and "register_adapter" in msg


def test_unknown_wrapper_inside_a_known_one_is_refused_too() -> None:
    with pytest.raises(wrapkit.UnsupportedModelError, match="HomeMadeWrapper"):
        wrapkit.adapt(torch.nn.DataParallel(HomeMadeWrapper(tiny_llama())))


def test_missing_config() -> None:
    wm = wrapkit.adapt(torch.nn.DataParallel(toy_model()))
    with pytest.raises(wrapkit.MissingConfigError) as info:
        _ = wm.config
    assert "ToyModel" in str(info.value) and isinstance(info.value, AttributeError)
    # hasattr() keeps working the way trainers use it.
    assert not hasattr(wm, "config")


def test_nested_backends_are_refused() -> None:
    inner = torch.nn.DataParallel(tiny_llama())
    with pytest.raises(wrapkit.UnsupportedModelError, match="nested"):
        wrapkit.adapt(torch.nn.DataParallel(inner))


def test_destroyed_process_group(group: Any) -> None:
    results = group.run(scenarios.destroyed_group_error, timeout=120)
    for text in results:
        assert text.startswith("DistributedStateError"), text
        assert "DistributedDataParallel" in text and "destroyed" in text


def test_ddp_after_destroy_in_subprocess(tmp_path: Any) -> None:
    """A wrapper outliving the default group: adapt() refuses instead of failing later in a collective."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist, wrapkit
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        dist.destroy_process_group()
        try:
            wrapkit.adapt(ddp)
        except wrapkit.DistributedStateError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "init_process_group" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch")
@pytest.mark.parametrize("spec", ["fsdp2", "zero3", "tp"])
def test_unusable_devices_raise_placement_errors_everywhere(group: Any, spec: str) -> None:
    from tests.sync import scenarios_scale

    for rank, obs in enumerate(group.run(scenarios_scale.bad_devices, spec, timeout=120)):
        assert "no cuda device" in obs["cuda"] and "install a cuda build" in obs["cuda"], obs["cuda"]
        assert "'not-a-device' is not a device" in obs["string"] and "2.5 is not a device" in obs["float"], obs
        # Only rank 1 named a device it cannot use; both ranks stopped before anything moved.
        want = "no cuda device" if rank == 1 else "another rank"
        assert want in obs["one_rank"], obs["one_rank"]
        assert all(obs[f"{k}_devices"] == ["cpu"] for k in ("cuda", "string", "float", "one_rank")), obs


def test_state_dict_errors_say_the_likely_cause() -> None:
    wm = wrapkit.adapt(tiny_llama(0))
    before = {k: v.clone() for k, v in wm.full_state_dict().items()}
    # A DDP model's state_dict(): every key behind "module.".
    prefixed = {f"module.{k}": v for k, v in tiny_llama(1).state_dict().items()}
    with pytest.raises(wrapkit.StateDictError) as info:
        wm.load_full_state_dict(prefixed)
    first = str(info.value).splitlines()[1]
    assert "wrapper's prefix" in first and "canonical_name" in first, first
    # A model of another size: every shared key differs in shape.
    with pytest.raises(wrapkit.StateDictError) as info:
        wm.load_full_state_dict(tiny_llama(1, hidden=64).state_dict())
    first = str(info.value).splitlines()[1]
    assert "differ in shape" in first and "another model size" in first, first
    # One wrong key among right ones: no guess, just the key.
    sd = dict(tiny_llama(1).state_dict())
    sd["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(wrapkit.StateDictError) as info:
        wm.load_full_state_dict(sd)
    assert "1 problem(s)" in str(info.value) and "another model size" not in str(info.value)
    after = wm.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "a refused load wrote"
