"""Training state that resumes anywhere: ``save_state`` on one backend, world size and topology, ``load_state``
on another, checked against the backends' own full readers and against the run that did not stop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import wrapkit
from tests.harness._matrix import long
from tests.training import scenarios_resume as sc
from wrapkit import StateDictError
from wrapkit.cli._models import tiny_llama

# (saved on, resumed on, precision, what the next steps are compared with):
#   "exact": bit for bit the run that did not stop (same backend and world size);
#   "close": that run within reduction order (another backend of the same family, same data layout);
#   "state": nothing beyond the state (another family's step arithmetic, or another data layout).
TWO_RANKS = [
    ("ddp", "ddp", "fp32", "exact"),
    ("fsdp2", "fsdp2", "fp32", "exact"),
    ("fsdp", "fsdp", "fp32", "exact"),
    ("zero2", "zero2", "fp32", "exact"),
    ("zero3", "zero3", "fp32", "exact"),
    ("fsdp2", "fsdp2", "bf16", "exact"),
    ("zero3", "zero3", "bf16", "exact"),
    ("zero0", "zero0", "fp32", "exact"),
    ("zero0", "zero0", "bf16", "exact"),
    ("ddp", "fsdp2", "fp32", "close"),
    ("fsdp2", "fsdp", "fp32", "close"),
    ("fsdp", "ddp", "fp32", "close"),
    ("fsdp", "fsdp2", "bf16", "close"),
    ("zero2", "zero3", "fp32", "close"),
    ("zero3", "zero1", "bf16", "close"),
    ("zero3", "fsdp2", "fp32", "state"),
    ("fsdp2", "zero3", "fp32", "state"),
    ("zero2", "ddp", "fp32", "state"),
    ("fsdp", "zero3", "fp32", "state"),
    ("zero2", "fsdp2", "bf16", "state"),
    ("zero0", "fsdp2", "fp32", "state"),
    ("tp", "fsdp2", "fp32", "state"),
    ("fsdp2", "tp", "fp32", "state"),
]
# Long: repeats of what default cases take (FSDP2's exact resume in bf16 beside ZeRO-3's, and ZeRO-0's and
# FSDP1's own resumes, whose states their cross-backend resumes write and read).
LONG_TWO_RANKS = {("zero0", "zero0", "fp32"), ("zero0", "zero0", "bf16"), ("fsdp", "fsdp", "fp32"),
                  ("fsdp2", "fsdp2", "bf16")}


def _groups(*specs: str) -> int:
    """Two param groups, as trainers build them; one where FSDP1 flattens a unit's parameters into one, or a
    DeepSpeed engine steps its own optimizer (one group as configured here)."""
    return 1 if any(s == "fsdp" or s.startswith("zero") for s in specs) else 2


def check(obs: dict[str, Any], follow: str) -> None:
    assert obs["extra"]["step"] == sc.STEPS, obs["extra"]
    assert obs["state"] == 0.0, f"a weight or moment differs from the saved one by {obs['state']}"
    got_lr, want_lr = obs["lr"]
    assert got_lr == want_lr and obs["scheduler_epoch"] == sc.STEPS, obs
    if obs["rng"] is not None:
        assert obs["rng"] and obs["skipped"] == [], obs
    if follow == "exact":
        got, want = obs["losses"]
        assert got == want and obs["after"] == 0.0, (got, want, obs["after"])
    elif follow == "close":
        got, want = obs["losses"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5 and obs["after"] < 1e-6, obs


@pytest.mark.parametrize("saved,resumed,precision,follow", [
    (long if case[:3] in LONG_TWO_RANKS else pytest.param)(*case, id="-".join(case[:3])) for case in TWO_RANKS])
def test_resume_on_two_ranks(group: Any, tmp_path: Path, saved: str, resumed: str, precision: str,
                             follow: str) -> None:
    groups = _groups(saved, resumed)
    group.run(sc.trained, str(tmp_path), saved, precision, groups=groups, timeout=120)
    results = group.run(sc.resumed, str(tmp_path), resumed, precision, follow=follow != "state", groups=groups,
                        timeout=120)
    for obs in results:
        check(obs, follow)


@pytest.mark.parametrize("saved,resumed,follow", [("fsdp2", "ddp", "close"), ("ddp", "zero3", "state"),
                                                  ("zero2", "zero2", "exact")])
def test_resume_with_lora(group: Any, tmp_path: Path, saved: str, resumed: str, follow: str) -> None:
    """A PEFT model: the frozen base weights are saved and restored as well, the optimizer's state is the
    adapters' alone, under PEFT's names."""
    groups = _groups(saved, resumed)
    group.run(sc.trained, str(tmp_path), saved, groups=groups, lora=True, timeout=120)
    for obs in group.run(sc.resumed, str(tmp_path), resumed, follow=follow != "state", groups=groups, lora=True,
                         timeout=120):
        check(obs, follow)


@pytest.mark.parametrize("saved,resumed", [
    ("fsdp2", "fsdp2-hsdp"), ("zero3", "zero3"),
    long("fsdp", "fsdp2"), long("ddp", "fsdp")])
def test_resume_from_two_ranks_on_four(group: Any, group4: Any, tmp_path: Path, saved: str, resumed: str) -> None:
    """Another world size (and topology): the state arrives exact; ranks the saving job lacked say so."""
    groups = _groups(saved, resumed)
    group.run(sc.trained, str(tmp_path), saved, groups=groups, timeout=120)
    spec, _, topology = resumed.partition("-")
    results = group4.run(sc.resumed, str(tmp_path), spec, "fp32", topology or "flat", follow=False, groups=groups,
                         timeout=120)
    for rank, obs in enumerate(results):
        check(obs, "state")
        if rank >= 2:
            assert obs["rng"] is None and "rank" in obs["skipped"][0], obs


@pytest.mark.parametrize("resumed", ["ddp", long("zero2")])
def test_resume_from_four_ranks_on_two(group: Any, group4: Any, tmp_path: Path, resumed: str) -> None:
    group4.run(sc.trained, str(tmp_path), "fsdp2", "fp32", "hsdp", groups=_groups(resumed), timeout=120)
    for obs in group.run(sc.resumed, str(tmp_path), resumed, follow=False, groups=_groups(resumed), timeout=120):
        check(obs, "state")


# -- bad input: every problem listed, on a plain model in this process, before anything changes -----------------
def _plain(seed: int = 0, layers: int = 2) -> tuple[Any, Any, Any]:
    wm = wrapkit.adapt(tiny_llama(seed, layers=layers))
    opt, sched = sc._optimizer(wm, 1e-2, 2)
    return wm, opt, sched


def _stepped(wm: Any, opt: Any, sched: Any) -> None:
    sc._steps(wm, opt, sched, 0)


def _snapshot(wm: Any, opt: Any) -> tuple[dict[str, Any], dict[int, Any]]:
    return ({k: v.clone() for k, v in wm.module.state_dict().items()},
            {id(p): {k: v.clone() if hasattr(v, "clone") else v for k, v in st.items()} for p, st in opt.state.items()})


def _unchanged(wm: Any, opt: Any, before: tuple[dict[str, Any], dict[int, Any]]) -> bool:
    weights, states = before
    now = _snapshot(wm, opt)
    return weights.keys() == now[0].keys() and all(torch.equal(weights[k], now[0][k]) for k in weights) and \
        states.keys() == now[1].keys()


def test_a_plain_model_resumes_bit_for_bit(tmp_path: Path) -> None:
    wm, opt, sched = _plain()
    _stepped(wm, opt, sched)
    wm.save_state(tmp_path / "s", opt, scheduler=sched, extra={"epoch": 3})
    want = sc._steps(wm, opt, sched, sc.STEPS)
    wm2, opt2, sched2 = _plain(seed=5)
    assert wm2.load_state(tmp_path / "s", opt2, scheduler=sched2).extra == {"epoch": 3}
    assert sc._steps(wm2, opt2, sched2, sc.STEPS) == want
    # The manifest says what was saved and from what.
    manifest = json.loads((tmp_path / "s" / "wrapkit_state.json").read_text())
    assert manifest["backend"] == "plain" and manifest["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert set(manifest["files"]) >= {".metadata", "__0_0.distcp"} and "torch" in manifest["versions"]


def test_bad_resumes_list_every_problem_and_change_nothing(tmp_path: Path) -> None:
    wm, opt, sched = _plain()
    _stepped(wm, opt, sched)
    state = tmp_path / "s"
    wm.save_state(state, opt, scheduler=sched)

    def refused(target: Any, optimizer: Any, scheduler: Any, *needles: str, directory: Path = state) -> None:
        before = _snapshot(target, optimizer)
        with pytest.raises(StateDictError) as err:
            target.load_state(directory, optimizer, scheduler=scheduler)
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))
        assert _unchanged(target, optimizer, before), "a refused load changed the model or optimizer"

    # Another model: a layer more. Its optimizer's groups differ too, and both are named.
    other, other_opt, other_sched = _plain(layers=3)
    refused(other, other_opt, other_sched, "parameters the checkpoint lacks (9)", "model.layers.2.", "param groups")
    # Another optimizer class.
    wm2, _, _ = _plain(seed=1)
    sgd = torch.optim.SGD(wm2.module.parameters(), lr=0.1, momentum=0.9)
    refused(wm2, sgd, None, "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD")
    # Another param-group layout: one group where two were saved; and no scheduler where one was saved.
    one = torch.optim.AdamW(wm2.module.parameters(), lr=1e-2)
    refused(wm2, one, None, "param groups differ: 2 group(s) of [", "the scheduler to restore it")
    # Optimizer state keys that differ: an AdamW that has stepped with amsgrad keeps max_exp_avg_sq too.
    wm3, opt3, sched3 = _plain(seed=2)
    for g in opt3.param_groups:
        g["amsgrad"] = True
    _stepped(wm3, opt3, sched3)
    refused(wm3, opt3, sched3, "optimizer state keys differ", "max_exp_avg_sq")
    # A truncated directory: one data file cut short, and one missing.
    cut = tmp_path / "cut"
    shutil.copytree(state, cut)
    data = cut / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    refused(wm2, *_plain(seed=1)[1:], "'__0_0.distcp' has 100 bytes", directory=cut)
    (cut / ".metadata").unlink()
    refused(wm2, *_plain(seed=1)[1:], "'.metadata' is missing", directory=cut)
    # Not a save_state directory at all.
    wm.save_pretrained(tmp_path / "pretrained")
    refused(wm2, *_plain(seed=1)[1:], "wrapkit_state.json", directory=tmp_path / "pretrained")


@pytest.mark.parametrize("kind", ["torchtitan", "accelerate"])
@pytest.mark.parametrize("target", ["fsdp2", "ddp", "fsdp"])
def test_another_trainers_checkpoint_resumes_on_any_backend(group: Any, tmp_path: Path, kind: str,
                                                            target: str) -> None:
    """torchtitan's CheckpointManager keys and accelerate's FSDP2 directories, read into another backend: the
    weights, every moment and step, and each group's hyperparameters (matched by its parameters' names)."""
    for obs in group.run(sc.foreign_checkpoint, str(tmp_path), kind, target, timeout=180):
        assert obs["diff"] == 0.0, obs
        assert obs["before"] is None or obs["before"] > 0, obs  # the target started elsewhere
        assert obs["lrs"] == ([3e-4, 7e-4] if target != "fsdp" else [3e-4]), obs["lrs"]
        assert obs["skipped"] and "scheduler" in obs["skipped"][0], obs["skipped"]
        # FSDP1 here steps one group: joining the checkpoint's two is reported, not done silently.
        assert (len(obs["skipped"]) == 2 and "joins parameters of 2 groups" in obs["skipped"][1]) == (
            target == "fsdp"), obs["skipped"]


def test_another_models_foreign_checkpoint_is_refused_on_every_rank(group: Any, tmp_path: Path) -> None:
    for obs in group.run(sc.foreign_checkpoint, str(tmp_path), "torchtitan", "other", timeout=180):
        assert obs["error"] is not None and "missing from the torchtitan checkpoint" in obs["error"], obs
        assert "model.layers.2" in obs["error"], obs["error"]


def test_a_tensor_split_by_state_dict_hooks_is_built_by_the_models_load_hooks(group: Any, tmp_path: Path) -> None:
    for obs in group.run(sc.hooked_foreign_checkpoint, str(tmp_path), timeout=120):
        assert obs["keys"] == ["0.wk.weight", "0.wq.weight", "0.wv.weight", "1.bias", "1.weight"], obs
        assert obs["differed"] and obs["equal"], obs


# -- a scheduler resumed into an optimizer whose groups come in another order -----------------------------------
# Those whose state holds more than base_lrs and _last_lr per group, or another scheduler's, by default; the rest
# (the same two lists) in the long selection.
SCHEDULERS = ["LambdaLR", "MultiStepLR", "CyclicLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR",
              "ChainedScheduler"] + [long(k) for k in (
                  "StepLR", "MultiplicativeLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
                  "CosineAnnealingLR", "CosineAnnealingWarmRestarts")]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_scheduler_follows_groups_listed_in_another_order(tmp_path: Path, kind: str) -> None:
    """The groups are matched by their parameters, and every per-group list of the scheduler's state follows: the
    resumed run's next steps equal the uninterrupted run's bit for bit (restored by position, the undecayed group
    ran on the decayed group's schedule from the first ``scheduler.step()`` on)."""
    wm = wrapkit.adapt(tiny_llama(0))
    opt, sched = sc._optimizer(wm, 1e-2, 2, kind)
    sc._steps(wm, opt, sched, 0)
    wm.save_state(tmp_path / "s", opt, scheduler=sched)
    want = sc._steps(wm, opt, sched, sc.STEPS)
    want_lr = [g["lr"] for g in opt.param_groups]
    wm2 = wrapkit.adapt(tiny_llama(5))
    opt2, sched2 = sc._optimizer(wm2, 5e-4, 2, kind, reverse=True)
    assert wm2.load_state(tmp_path / "s", opt2, scheduler=sched2).skipped == []
    assert sc._steps(wm2, opt2, sched2, sc.STEPS) == want
    assert [g["lr"] for g in opt2.param_groups][::-1] == want_lr
    got = wm2.module.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in wm.module.state_dict().items())


def test_a_scheduler_whose_per_group_state_cannot_follow_is_refused(tmp_path: Path) -> None:
    """A scheduler of the trainer's own, with a list as long as the groups that wrapkit does not know: refused on
    every rank before anything changes, where the groups come in another order; in the saved order it resumes."""

    class Warmups(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, opt: Any) -> None:
            self.warmup_steps = [1 + i for i in range(len(opt.param_groups))]
            super().__init__(opt, lambda s: 1.0)

    wm = wrapkit.adapt(tiny_llama(0))
    opt, _ = sc._optimizer(wm, 1e-2, 2)
    sched = Warmups(opt)
    sc._steps(wm, opt, sched, 0)
    wm.save_state(tmp_path / "s", opt, scheduler=sched)
    wm2 = wrapkit.adapt(tiny_llama(5))
    opt2, _ = sc._optimizer(wm2, 5e-4, 2, reverse=True)
    sched2 = Warmups(opt2)
    before = _snapshot(wm2, opt2)
    with pytest.raises(StateDictError, match="warmup_steps") as err:
        wm2.load_state(tmp_path / "s", opt2, scheduler=sched2)
    assert "saved order" in str(err.value) and "Warmups" in str(err.value)
    assert _unchanged(wm2, opt2, before) and sched2.last_epoch == 0
    opt3, _ = sc._optimizer(wm2, 5e-4, 2)
    wm2.load_state(tmp_path / "s", opt3, scheduler=Warmups(opt3))


@pytest.mark.parametrize("spec", ["ddp", "fsdp2", long("fsdp")])
def test_a_scheduler_follows_reordered_groups_on_two_ranks(group: Any, tmp_path: Path, spec: str) -> None:
    group.run(sc.trained, str(tmp_path), spec, scheduler="LambdaLR", timeout=120)
    for obs in group.run(sc.resumed, str(tmp_path), spec, scheduler="LambdaLR", reverse=True, timeout=120):
        check(obs, "close" if spec == "fsdp" else "exact")
