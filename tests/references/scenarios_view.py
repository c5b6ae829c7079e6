"""Scenarios for the adapter-disabled reference view of a PEFT policy: every operation of the
view must see the base model (adapters off, base names), on every backend. Run on every rank
of the worker group (in-process for ``plain>peft``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import wrapkit
from tests.references.scenarios_reference import _Trainer
from wrapkit.cli._models import build, tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128
PROMPT = TOKENS[:1, :4]


def _logits(out: Any) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).detach().float().cpu()


def _train(wm: Any, steps: int = 2) -> None:
    """A few steps so that the LoRA matrices are no longer the identity they start as."""
    trainer = _Trainer(wm, lr=5e-2)
    for _ in range(steps):
        trainer.step()


def _refused(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except wrapkit.WrapkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def view_operations(spec: str, tmp: str) -> dict[str, Any]:
    policy = wrapkit.adapt(build(spec))
    _train(policy)
    base = tiny_llama().eval()  # the same seed: the weights the frozen base model still has
    ref = wrapkit.prepare_reference(policy.module, None)
    modes = [m.training for m in policy.module.modules()]
    grads = [p.requires_grad for p in policy.module.parameters()]

    obs: dict[str, Any] = {"type": type(ref).__name__, "stack": ref.stack, "backend": ref.backend}
    with torch.no_grad():
        want = _logits(base(TOKENS))
        want_tokens = base.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
        policy_logits = _logits(policy(TOKENS))
    obs["policy_differs"] = _max_diff(policy_logits, want)
    obs["forward"] = _max_diff(_logits(ref(TOKENS)), want)

    with ref.generation() as m:
        obs["policy_training_inside"] = sum(x.training for x in policy.module.modules())
        obs["generation_logits"] = _max_diff(_logits(m(TOKENS)), want)
        obs["generation_tokens"] = m.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist() == want_tokens
    with ref.gathered() as m, torch.no_grad():
        obs["gathered_logits"] = _max_diff(_logits(m(TOKENS)), want)
    obs["modes_restored"] = [x.training for x in policy.module.modules()] == modes
    obs["requires_grad_restored"] = [p.requires_grad for p in policy.module.parameters()] == grads

    base_params = dict(base.named_parameters(remove_duplicate=False))
    full = {name: t.detach().cpu().clone() for name, t in ref.named_full_parameters()}
    obs["named_full_names"] = sorted(full) == sorted(base_params)
    obs["named_full_diff"] = max(_max_diff(full[n], p) for n, p in base_params.items() if n in full)

    sd = ref.full_state_dict()
    want_sd = base.state_dict()
    if ref.rank == 0:
        obs["state_keys"] = list(sd) == list(want_sd)
        obs["state_diff"] = max(_max_diff(sd[k], v) for k, v in want_sd.items() if k in sd)
        obs["lora_keys"] = [k for k in sd if "lora" in k or "base_layer" in k]
    obs["merge_same"] = ref.full_state_dict(merge_adapters=True).keys() == sd.keys()
    obs["num_parameters"] = ref.num_parameters() == sum(p.numel() for p in base.parameters())
    obs["describe"] = ref.describe()

    path = os.path.join(tmp, f"view-{spec.replace('>', '-')}.safetensors")
    ref.save(path)
    saved = wrapkit.read_checkpoint(path)
    same_keys = sorted(saved) == sorted(want_sd)
    obs["saved_diff"] = max(_max_diff(saved[k], v) for k, v in want_sd.items()) if same_keys else -1

    # copy_to from the view: a fresh base model (another seed) ends up with the base weights.
    target = wrapkit.adapt(tiny_llama(seed=1))
    ref.copy_to(target)
    obs["copy_diff"] = max(_max_diff(v, want_sd[k]) for k, v in target.module.state_dict().items())
    ema = wrapkit.adapt(tiny_llama(seed=1))
    before = ema.module.state_dict()["lm_head.weight"].clone()
    ref.copy_to(ema, alpha=0.25)
    expect = 0.25 * want_sd["lm_head.weight"] + 0.75 * before
    obs["ema_diff"] = _max_diff(ema.module.state_dict()["lm_head.weight"], expect)

    # What a view cannot do, refused on every rank with nothing changed.
    obs["refused"] = {
        "load_full_state_dict": _refused(lambda: ref.load_full_state_dict(want_sd)),
        "load": _refused(lambda: ref.load(path)),
        "copy_into": _refused(lambda: target.copy_to(ref)),
        "copy_into_policy": _refused(lambda: ref.copy_to(policy)),
        "gathered_modifier": _refused(lambda: ref.gathered(modifier_rank=0).__enter__()),
        "place_elsewhere": _refused(lambda: ref.place("meta")),
        "as_policy": _refused(lambda: wrapkit.prepare_reference(ref)),
        "copy_to_dict": _refused(lambda: ref.copy_to({})),
    }
    obs["place_home"] = ref.place() is ref and ref.to_eval_frozen() is ref
    obs["adapt_is_same"] = wrapkit.adapt(ref) is ref
    obs["is_protocol"] = isinstance(ref, wrapkit.WrappedModel)
    with torch.no_grad():
        obs["policy_unchanged"] = _max_diff(_logits(policy(TOKENS)), policy_logits)
    obs["requires_grad_final"] = [p.requires_grad for p in policy.module.parameters()] == grads
    return obs


def merged_policy_refused() -> dict[str, Any]:
    """A policy whose LoRA is merged into its weights (``merge_adapter()``) has no base weights to
    view: every operation of the view refuses, and the policy's weights stay merged."""
    policy = wrapkit.adapt(build("peft"))
    _train(policy)
    ref = wrapkit.prepare_reference(policy.module, None)
    peft_model: Any = policy.unwrap()
    peft_model.merge_adapter()
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    errors = {
        "forward": _refused(lambda: ref(TOKENS)),
        "generation": _refused(lambda: ref.generation().__enter__()),
        "full_state_dict": _refused(lambda: ref.full_state_dict()),
        "named_full_parameters": _refused(lambda: next(ref.named_full_parameters())),
    }
    unchanged = all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())
    peft_model.unmerge_adapter()
    with torch.no_grad():
        works_again = _max_diff(_logits(ref(TOKENS)), _logits(tiny_llama().eval()(TOKENS))) < 1e-5
    return {"errors": errors, "unchanged": unchanged, "works_again": works_again}
