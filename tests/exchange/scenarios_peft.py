"""Scenarios for PEFT adapter checkpoints: ``save_pretrained(adapters_only=True)`` and ``load`` of
the directory it writes, on every backend (run on every rank of a worker group)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

import wrapkit
from wrapkit.cli._models import INDEPENDENT, build, fill_adapters, tiny_llama

TOKENS = torch.arange(16).reshape(2, 8) % 128
SECOND = "second"


def lora_model(seed: int, *, zeroed: bool = False, base_seed: int = 0) -> torch.nn.Module:
    """A plain PEFT Llama with two adapters (``default`` on q/v, ``second`` on k_proj). Every LoRA
    matrix holds distinct random values (or zeros), so each rank's slice of it differs from the
    others': a file holding one rank's slice cannot pass for the whole."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model: Any = get_peft_model(tiny_llama(base_seed), config)
    model.add_adapter(SECOND, LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"]))
    return fill_adapters(model, seed, zeroed)


def _wrapped(case: dict[str, Any], model: torch.nn.Module) -> Any:
    return wrapkit.adapt(build(case["spec"], model=model, precision=case.get("precision", "fp32"),
                               topology=case.get("topology", "flat")))


def _shared_dir() -> str:
    import torch.distributed as dist

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _lora_entries(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if "lora_" in k}


def _files(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), directory) for r, _, fs in os.walk(directory) for f in fs)


def _peft_loaded(directory: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PEFT's own load of ``directory`` (and of the second adapter's subdirectory) onto a fresh base."""
    from peft import PeftModel

    # In the saved dtype, as the trained model computes: PEFT would otherwise upcast 16-bit adapters.
    model: Any = PeftModel.from_pretrained(tiny_llama(0).to(dtype), directory, autocast_adapter_dtype=False)
    model.load_adapter(os.path.join(directory, SECOND), adapter_name=SECOND, autocast_adapter_dtype=False)
    with torch.no_grad():
        logits = model(TOKENS).logits.float()
    return logits, {k: v.clone() for k, v in _lora_entries(model.state_dict()).items()}


def adapter_checkpoints(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For each case ``{"spec", "precision", "topology"}``: save the adapters of a trained LoRA model
    wrapped that way, read the directory with PEFT, and load it into a zeroed model wrapped the same
    way (every rank reading, and rank 0 reading for all)."""
    import torch.distributed as dist

    from tests.harness._matrix import key

    root = _shared_dir()
    out: dict[str, Any] = {}
    try:
        for case in cases:
            want = lora_model(1)
            wm = _wrapped(case, lora_model(1))
            # A model that is not distributed is each process's own, and so is its directory; so is
            # each half's in the layouts that make one model of each half of the ranks.
            rank = dist.get_rank()
            model = rank if case["spec"] == "plain" else rank // 2 if case["topology"] in INDEPENDENT else 0
            directory = os.path.join(root, "-".join(str(v) for v in case.values()) + f"-model{model}")
            live = _lora_entries(wm.full_state_dict(rank0_only=False))
            wm.save_pretrained(directory, adapters_only=True)
            obs: dict[str, Any] = {"rank": dist.get_rank()}
            if wm.rank == 0:
                from safetensors.torch import load_file

                obs["files"] = _files(directory)
                # PEFT's own selection from the plain model is the oracle: the same keys, and bit for
                # bit the trained values in the dtype the wrapped model holds them in.
                from peft.utils import get_peft_model_state_dict

                def live_key(saved_key: str, adapter: str) -> str:
                    for m in ("lora_A", "lora_B"):
                        saved_key = saved_key.replace(f".{m}.weight", f".{m}.{adapter}.weight")
                    return saved_key

                dt = next(v.dtype for k, v in live.items() if ".second." in k)  # the module's own
                for name, adapter in (("file_exact", "default"), ("second_exact", SECOND)):
                    sub = "" if adapter == "default" else adapter
                    saved = load_file(os.path.join(directory, sub, "adapter_model.safetensors"))
                    oracle = get_peft_model_state_dict(want, adapter_name=adapter)
                    # The trained values as the module holds them, in the dtype the wrapped model exports
                    # them in (a 16-bit engine's fp32 masters of its trainable ones).
                    obs[name] = sorted(saved) == sorted(oracle) and all(
                        torch.equal(saved[k], oracle[k].to(dt).to(live[live_key(k, adapter)].dtype)) for k in saved)
                logits, loaded = _peft_loaded(directory, dt)
                expected = want.to(dt)
                with torch.no_grad():
                    obs["peft_outputs_equal"] = torch.equal(logits, expected(TOKENS).logits.float())
                want_sd = _lora_entries(expected.state_dict())
                obs["peft_adapters_equal"] = sorted(loaded) == sorted(want_sd) and all(
                    torch.equal(loaded[k], v) for k, v in want_sd.items())
                with torch.no_grad():
                    obs["policy_diff"] = float((logits - _forward(wm)).abs().max())
            else:
                _forward(wm)  # the forward is collective on sharded backends
            # Resume: a model with another base and zeroed adapters gets the adapters, and keeps its base.
            for how, src_rank in (("each", None), ("src0", 0)):
                target = _wrapped(case, lora_model(0, zeroed=True, base_seed=1))
                before = target.full_state_dict(rank0_only=False)
                target.load(directory, src_rank=src_rank)
                after = target.full_state_dict(rank0_only=False)
                obs[f"adapters_loaded_{how}"] = all(torch.equal(after[k], v) for k, v in live.items())
                obs[f"base_untouched_{how}"] = all(torch.equal(after[k], v) for k, v in before.items() if k not in live)
            out[key(case)] = obs
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _forward(wm: Any) -> torch.Tensor:
    with torch.no_grad(), wm.generation() as inner:
        return inner(TOKENS.to(wm.device)).logits.float().cpu()  # type: ignore[no-any-return]


def adapter_refusals(spec: str) -> dict[str, Any]:
    """Bad directories and arguments for adapter checkpoints on ``spec`` (two ranks): what each raises,
    and whether the model and an earlier checkpoint came through unchanged."""
    import json

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    root = _shared_dir()
    case = {"spec": spec}
    out: dict[str, Any] = {}

    def attempt(fn: Any) -> str:
        try:
            fn()
            return "ok"
        except wrapkit.WrapkitError as exc:
            return f"{type(exc).__name__}: {exc}"

    try:
        wm = _wrapped(case, lora_model(1))
        before = wm.full_state_dict(rank0_only=False)
        good = os.path.join(root, "good")
        wm.save_pretrained(good, adapters_only=True)
        listing = _files(good)
        # Saves refused before anything is written: the earlier checkpoint stays.
        out["save_unknown_adapter"] = attempt(lambda: wm.save_pretrained(good, adapters_only=True,
                                                                         adapter_names=["nope"]))
        out["save_merge_too"] = attempt(lambda: wm.save_pretrained(good, adapters_only=True, merge_adapters=True))
        out["names_without_only"] = attempt(lambda: wm.save_pretrained(good, adapter_names=["default"]))
        plain = _wrapped(case, tiny_llama(0))
        out["save_no_peft"] = attempt(lambda: plain.save_pretrained(os.path.join(root, "none"), adapters_only=True))
        out["load_into_no_peft"] = attempt(lambda: plain.load(good))
        view = wrapkit.prepare_reference(wm)  # the policy with its adapters off
        out["save_from_view"] = attempt(lambda: view.save_pretrained(os.path.join(root, "none"), adapters_only=True))
        out["earlier_kept"] = _files(good) == listing and not os.path.exists(os.path.join(root, "none"))

        # Directories that do not fit the model, built by rank 0 from the good one.
        bad = {name: os.path.join(root, name) for name in ("keys", "config", "pickle", "empty", "only_second")}
        if dist.get_rank() == 0:
            for path in bad.values():
                shutil.copytree(good, path)
            weights = os.path.join(bad["keys"], "adapter_model.safetensors")
            sd = load_file(weights)
            dropped = sorted(sd)[0]
            sd.pop(dropped)
            sd["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 32)
            save_file(sd, weights, metadata={"format": "pt"})
            config = os.path.join(bad["config"], "adapter_config.json")
            with open(config) as f:
                saved = json.load(f)
            saved.update(r=8, target_modules=["q_proj", "k_proj"])
            with open(config, "w") as f:
                json.dump(saved, f)
            os.replace(os.path.join(bad["pickle"], "adapter_model.safetensors"),
                       os.path.join(bad["pickle"], "adapter_model.bin"))
            for name in os.listdir(bad["empty"]):
                path = os.path.join(bad["empty"], name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                os.unlink(os.path.join(bad["only_second"], name))
        dist.barrier()
        out["dropped_key"] = dropped if dist.get_rank() == 0 else None
        target = _wrapped(case, lora_model(0, zeroed=True))
        held = target.full_state_dict(rank0_only=False)
        for name in ("keys", "config", "pickle"):
            out[f"load_{name}"] = attempt(lambda name=name: target.load(bad[name]))
        out["load_empty_named"] = attempt(lambda: target.load(bad["empty"], adapter_name="default"))
        out["load_missing"] = attempt(lambda: target.load(os.path.join(root, "missing")))
        out["load_bad_name"] = attempt(lambda: target.load(good, adapter_name=""))
        only_one = _wrapped(case, _one_adapter())
        out["load_second_into_one"] = attempt(lambda: only_one.load(bad["only_second"]))
        after = target.full_state_dict(rank0_only=False)
        out["unchanged"] = all(torch.equal(after[k], v) for k, v in held.items())
        # The second adapter's files alone: from its subdirectory and from the directory itself.
        out["load_second_by_name"] = attempt(lambda: target.load(bad["only_second"], adapter_name=SECOND))
        out["load_second_subdir"] = attempt(
            lambda: target.load(os.path.join(bad["only_second"], SECOND), adapter_name=SECOND))
        loaded = target.full_state_dict(rank0_only=False)
        out["second_loaded"] = all(torch.equal(loaded[k], before[k]) for k in loaded if f".{SECOND}." in k)
        out["default_still_zero"] = all(torch.equal(loaded[k], held[k]) for k in loaded if ".default." in k)
        out["model_unchanged_by_saves"] = all(torch.equal(v, before[k])
                                              for k, v in wm.full_state_dict(rank0_only=False).items())
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _one_adapter() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # type: ignore[no-any-return]


def modules_to_save(spec: str) -> dict[str, Any]:
    """LoRA beside a trained copy of the head (``modules_to_save``) wrapped as ``spec``: the copy is saved
    as PEFT saves it, whole, and resumed."""
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model

    def model(seed: int) -> Any:
        m: Any = get_peft_model(tiny_llama(0), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_" in name or "modules_to_save" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
        return m

    want = model(1)
    root = _shared_dir()
    try:
        wm = _wrapped({"spec": spec}, model(1))
        directory = os.path.join(root, "mts")
        wm.save_pretrained(directory, adapters_only=True)
        out: dict[str, Any] = {}
        if dist.get_rank() == 0:
            from peft.utils import get_peft_model_state_dict
            from safetensors.torch import load_file

            out["keys"] = sorted(load_file(os.path.join(directory, "adapter_model.safetensors")))
            out["peft_keys"] = sorted(get_peft_model_state_dict(want))
            loaded: Any = PeftModel.from_pretrained(tiny_llama(0), directory)
            with torch.no_grad():
                out["outputs_equal"] = torch.equal(loaded(TOKENS).logits, want(TOKENS).logits)
        target = _wrapped({"spec": spec}, model(2))
        target.load(directory)
        got, live = target.full_state_dict(rank0_only=False), wm.full_state_dict(rank0_only=False)
        out["resumed"] = all(torch.equal(got[k], v) for k, v in live.items())
        # Merged exports hold the trained copy under the base name, as PEFT's merge_and_unload() does.
        import copy

        merged = {k: v.clone() for k, v in copy.deepcopy(want).merge_and_unload().state_dict().items()}
        streamed = {n: t.clone() for b in wm.stream_full_parameters(merge_adapters=True)
                    for n, t in b.named_tensors()}
        saved = os.path.join(root, "merged")
        wm.save_pretrained(saved, merge_adapters=True)
        from tests.exchange.scenarios_families import _differences, _files

        out["merged_full"] = _differences(wm.full_state_dict(rank0_only=False, merge_adapters=True), merged)
        out["merged_stream"] = _differences(streamed, merged)
        out["merged_saved"] = _differences(_files(saved), merged)
        out["live_unchanged"] = _differences(wm.full_state_dict(rank0_only=False), live)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out
