"""Scenarios for models prepared by accelerate, run on the shared two-rank group."""

from __future__ import annotations

import copy
from typing import Any

import torch

import wrapkit
from tests.integrations import accelerate_cpu
from wrapkit.cli._models import tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128
PROMPT = TOKENS[:, :4]


def _greedy(model: torch.nn.Module, new: int = 3, **kwargs: Any) -> torch.Tensor:
    return model.generate(PROMPT, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)  # type: ignore


def prepared(kind: str) -> dict[str, Any]:
    """``adapt(accelerator.prepare(model))`` for one of accelerate's setups, then a reference,
    a training step and a generation through wrapkit."""
    with accelerate_cpu.clean_state():
        accelerator = accelerate_cpu.accelerator(kind)
        model = tiny_llama()
        expected = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        wm = wrapkit.adapt(model)
        ref = wrapkit.prepare_reference(wm)
        with torch.no_grad():
            ref_diff = float((ref(TOKENS).logits - wm(TOKENS).logits).abs().max())
        loss = wm(TOKENS, labels=TOKENS).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        with wm.generation() as m:
            out = _greedy(m)
        return {
            "distributed_type": str(accelerator.distributed_type).split(".")[-1],
            "backend": wm.backend,
            "zero_stage": wm.zero_stage,
            "is_sharded": wm.is_sharded,
            "config": type(wm.config).__name__,
            "num_parameters": wm.num_parameters(),
            "expected": expected,
            "ref_backend": ref.backend,
            "ref_sharded": ref.is_sharded,
            "ref_diff": ref_diff,
            "generated": tuple(out.shape),
            "training_after": all(m.training for m in wm.unwrap().modules()),
        }


def trl_dropins(kind: str) -> dict[str, Any]:
    """wrapkit's TRL drop-ins next to an accelerate-prepared policy: the reference that
    ``prepare_deepspeed``/``prepare_fsdp`` return, and ``unwrap_model_for_generation``."""
    from wrapkit.integrations.trl import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation

    with accelerate_cpu.clean_state():
        accelerator = accelerate_cpu.accelerator(kind)
        model = tiny_llama()
        model.gradient_checkpointing_enable()
        plain = copy.deepcopy(model).eval()
        with torch.no_grad():
            want_logits = plain(TOKENS).logits
            want_tokens = _greedy(plain)
        full_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        prepare = prepare_deepspeed if kind.startswith("zero") else prepare_fsdp
        ref = prepare(copy.deepcopy(model), accelerator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        policy = wrapkit.adapt(model)

        rw = wrapkit.adapt(ref)
        with torch.no_grad():
            ref_diff = float((ref(TOKENS).logits - want_logits).abs().max())
        obs: dict[str, Any] = {
            "ref_type": type(ref).__name__,
            "ref_backend": rw.backend,
            "ref_stage": rw.zero_stage,
            "ref_diff": ref_diff,
            # As TRL's: requires_grad untouched (TRL passes policies through prepare_deepspeed too).
            "ref_requires_grad": all(p.requires_grad for p in ref.parameters()),
            "ref_eval": not any(m.training for m in ref.modules()),
            "ref_resident": rw.resident_parameter_bytes() / full_bytes,
            "outside_blocks": 1 - sum(p.numel() for p in plain.model.layers.parameters())
                              / sum(p.numel() for p in plain.parameters()),
            "ref_sharded_blocks": sum(hasattr(m, "reshard") and type(m).__name__.startswith("FSDP")
                                      for m in rw.unwrap().model.layers),
        }

        ckpt_before = [m.gradient_checkpointing for m in policy.unwrap().modules()
                       if "gradient_checkpointing" in m.__dict__]
        inner = policy.unwrap()
        old_config = inner.generation_config
        with unwrap_model_for_generation(model, accelerator, generation_kwargs={"max_new_tokens": 2}) as m:
            obs["inside_training"] = any(x.training for x in m.modules())
            obs["inside_ckpt"] = any(getattr(x, "gradient_checkpointing", False) for x in m.modules())
            obs["tokens_equal"] = bool(torch.equal(_greedy(m), want_tokens))
            obs["override_len"] = int(m.generate(PROMPT, do_sample=False, pad_token_id=0).shape[1])  # type: ignore
        obs["config_restored"] = inner.generation_config is old_config
        obs["training_after"] = all(x.training for x in policy.unwrap().modules())
        obs["ckpt_restored"] = ckpt_before == [m.gradient_checkpointing for m in policy.unwrap().modules()
                                               if "gradient_checkpointing" in m.__dict__] and any(ckpt_before)
        if kind == "zero3":
            # Without gathering, generation runs through ZeRO-3's hooks: slower, same tokens, same restoring.
            with unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=False) as m:
                obs["ungathered_sharded"] = policy.resident_parameter_bytes() < full_bytes
                obs["ungathered_equal"] = bool(torch.equal(_greedy(m), want_tokens))
                obs["ungathered_training"] = any(x.training for x in m.modules())
            obs["ungathered_after"] = all(x.training for x in policy.unwrap().modules())
        # Modes come back when generation raises, too.
        try:
            with unwrap_model_for_generation(model, accelerator):
                raise KeyError("inside")
        except KeyError:
            pass
        obs["training_after_error"] = all(x.training for x in policy.unwrap().modules())
        # And the policy still trains after all that.
        loss = policy(TOKENS, labels=TOKENS).loss
        accelerator.backward(loss)
        optimizer.step()
        obs["loss_finite"] = bool(torch.isfinite(loss.detach()))
        return obs


def trl_dropin_errors(kind: str) -> list[str]:
    """Bad input to the drop-ins: typed errors, raised before any collective."""
    from wrapkit.integrations.trl import prepare_deepspeed, prepare_fsdp

    errors = []
    with accelerate_cpu.clean_state():
        accelerator = accelerate_cpu.accelerator(kind)
        for fn, arg in ((prepare_deepspeed, None), (prepare_fsdp, None),
                        (prepare_deepspeed if kind != "zero3" else prepare_fsdp, tiny_llama())):
            try:
                fn(arg, accelerator)  # type: ignore[arg-type]
            except wrapkit.ReferenceModelError as exc:
                errors.append(str(exc))
    return errors


def mixed_precision(kind: str) -> dict[str, Any]:
    """accelerate's ``mixed_precision="bf16"``: generation and the reference compute like the
    prepared model's own forward, and greedy generate() decodes its tokens."""
    with accelerate_cpu.clean_state():
        accelerator = accelerate_cpu.accelerator(kind, "bf16")
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        wm = wrapkit.adapt(model)
        loss = wm(TOKENS, labels=TOKENS).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        plain = tiny_llama()
        plain.load_state_dict(wm.full_state_dict(rank0_only=False))
        wm.module.eval()
        with torch.no_grad():
            own = wm(TOKENS).logits
            # The same weights in fp32 give other logits: bf16 is really in effect.
            half_effect = float((own.float() - plain.eval()(TOKENS).logits).abs().max())
            seq = PROMPT
            for _ in range(3):
                seq = torch.cat([seq, wm(seq).logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
        wm.module.train()
        with wm.generation() as m:
            inside = m(TOKENS).logits
            out = _greedy(m, attention_mask=torch.ones_like(PROMPT), min_new_tokens=3, eos_token_id=None)
        ref = wrapkit.prepare_reference(wm)
        with torch.no_grad():
            ref_logits = ref(TOKENS).logits
        return {
            "own_dtype": str(own.dtype), "generation_dtype": str(inside.dtype), "ref_dtype": str(ref_logits.dtype),
            "ref_diff": float((ref_logits.float() - own.float()).abs().max()),
            "ref_fp32_diff": float((ref_logits.float() - plain(TOKENS).logits).abs().max()),
            "generation_diff": float((inside.float() - own.float()).abs().max()),
            "same_tokens": bool(torch.equal(out, seq)), "half_effect": half_effect,
            "training_after": all(m.training for m in wm.unwrap().modules()),
        }
