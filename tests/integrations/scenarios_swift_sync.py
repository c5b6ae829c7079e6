"""ms-swift's own GRPO weight sync (``RolloutTrainerMixin._move_model_to_vllm``) on models prepared by accelerate,
run on every rank of the shared two-rank group in ms-swift's environment, after ``patch_swift()``: in server mode (a
client recording what ms-swift's flattened buckets carry) and colocate mode (an engine whose ``load_weights`` and
``add_lora`` record), against the Hub's layout of the same weights (an unsharded twin's ``save_pretrained``, after
PEFT's ``merge_and_unload()``) and PEFT's own adapter state dict."""

from __future__ import annotations

import contextlib
import copy
import importlib
import types
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.exchange.scenarios_families import _differences
from tests.integrations import accelerate_cpu
from tests.integrations.scenarios_trl_sync import _oracle, _peft, _train_step
from wrapkit.cli._families import family_model


class SwiftClient:
    """ms-swift's ``VLLMClient`` as its GRPO sync uses it: flattened buckets unpacked by ms-swift's own bucket class."""

    def __init__(self) -> None:
        self.full: dict[str, torch.Tensor] = {}
        self.adapter: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    @staticmethod
    def _unpack(metadatas: Any, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        from swift.rlhf_trainers.utils import FlattenedTensorBucket

        bucket = FlattenedTensorBucket(metadata=metadatas, flattened_tensor=flat)
        return {k: v.detach().to("cpu", copy=True) for k, v in bucket.reconstruct_tensors().items()}

    def update_flattened_params(self, metadatas: Any, flat: torch.Tensor) -> None:
        self.full.update(self._unpack(metadatas, flat))

    def update_adapter_flattened_param(self, config: Any, metadatas: Any, flat: torch.Tensor) -> None:
        self.adapter = self._unpack(metadatas, flat)

    def get_model_state_keys(self) -> list[str]:
        return []  # the engine's own names, for ms-swift's ``.base_layer`` mapping: none to map here

    def process_weights_after_loading(self) -> None:
        self.calls.append("process_weights_after_loading")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")

    def take(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        out = (self.full, self.adapter)
        self.full, self.adapter = {}, {}
        return out


class SwiftEngine:
    """ms-swift's colocated engine as its sync reaches it (``inner_model.load_weights``, ``engine.add_lora``)."""

    def __init__(self) -> None:
        self.full: dict[str, torch.Tensor] = {}
        self.adapter: dict[str, torch.Tensor] = {}
        outer = self

        class Inner(torch.nn.Module):  # a module, as vLLM's model is (its layers are looked at after a sync)
            def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
                return iter(())  # as the client's get_model_state_keys

            def load_weights(self, weights: Any) -> None:
                outer.full.update({n: t.detach().to("cpu", copy=True) for n, t in weights})

        class Engine:
            model_config = None  # ms-swift's post-load step needs vLLM's: skipped without one

            def add_lora(self, request: Any) -> None:
                outer.adapter = {k: v.detach().to("cpu", copy=True) for k, v in request.lora_tensors.items()}

            def reset_prefix_cache(self) -> None:
                pass

            def reset_encoder_cache(self) -> None:
                pass

        self.inner_model, self.engine = Inner(), Engine()

    def take(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        out = (self.full, self.adapter)
        self.full, self.adapter = {}, {}
        return out


def _trainer(model: torch.nn.Module, accelerator: Any, mode: str, lora: bool, served_lora: bool) -> Any:
    """ms-swift's GRPO trainer as its sync sees it: the model inside the prepared wrapper, its rollout in ``mode``."""
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = types.SimpleNamespace(tuner_type="lora" if lora else "full", async_generate=False, sleep_level=0,
                                   enable_flattened_weight_sync=True, report_to=[],
                                   move_model_batches=None)
    t.model, t.accelerator, t.vllm_mode = model, accelerator, mode
    t.rollout_enable_lora, t.base_sync_done = served_lora, False
    t._is_fsdp2 = getattr(accelerator, "is_fsdp2", False)
    t._cached_vllm_param_names = None
    if mode == "server":
        t.vllm_client = SwiftClient()
    else:
        t.engine = SwiftEngine()
    return t


def _received(t: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    if t.vllm_mode == "server":
        return t.vllm_client.take() if t.accelerator.is_main_process else None
    return t.engine.take()  # type: ignore[no-any-return]


def _case(kind: str, case: dict[str, Any], patched: bool = True) -> dict[str, Any]:
    from peft.utils import get_peft_model_state_dict

    from wrapkit.integrations.swift import patch_swift

    out: dict[str, Any] = {"rank": dist.get_rank(), "syncs": []}
    served = case.get("served_lora", False)
    with accelerate_cpu.clean_state():
        model = family_model(case["family"], 0)
        layers = list(model._no_split_modules or [])
        model = _peft(model, case.get("peft"), 0)
        template = copy.deepcopy(model)
        settings: dict[str, Any] = {}
        if kind.startswith("zero") and getattr(model.config, "hidden_size", None) is None:
            settings["hidden"] = model.config.get_text_config().hidden_size
        accelerator = accelerate_cpu.accelerator(kind, layers=layers, **settings)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        prepared, optimizer = accelerator.prepare(model, optimizer)
        inner = accelerator.unwrap_model(prepared)  # what ms-swift's trainer holds as self.model
        if case.get("unlisted"):
            # An accelerator that lists no prepared model: the trainer's module is all the sync is given.
            accelerator._models.clear()
        trainers = {mode: _trainer(inner, accelerator, mode, bool(case.get("peft")), served)
                    for mode in ("server", "colocate")}
        mixin = importlib.import_module("swift.rlhf_trainers.rollout_mixin")
        request_type = mixin.TensorLoRARequest
        if request_type is None:  # vLLM's LoRA request, which needs vLLM: the stand-in engine takes plain fields
            mixin.TensorLoRARequest = types.SimpleNamespace
        if not patched:  # ms-swift's own walk, for comparison: its parameter groups as its trainer makes them
            for t in trainers.values():
                t.parameter_groups, t.parameter_groups_no_lora = t.split_batches()
        with patch_swift() if patched else contextlib.nullcontext(), contextlib.ExitStack() as undo:
            undo.callback(setattr, mixin, "TensorLoRARequest", request_type)
            for step in range(2):
                live = wrapkit.adapt(prepared).full_state_dict(rank0_only=False)
                # Merged weights; where the rollout serves the adapter, the base weights alone (sent on the first
                # sync only) and the adapter as PEFT saves it.
                want = _oracle(case, template, live, merge=not served)
                want_adapter: dict[str, torch.Tensor] = {}
                if served:
                    twin: Any = copy.deepcopy(template)
                    twin.load_state_dict(live)
                    want_adapter = {k: v.clone() for k, v in get_peft_model_state_dict(twin).items()}
                sync: dict[str, Any] = {}
                for mode, t in trainers.items():
                    t._move_model_to_vllm()
                    got = _received(t)
                    if got is None:
                        continue
                    full, adapter = got
                    sync[mode] = _differences(full, want) if step == 0 or not served else [
                        f"full weights sent again: {len(full)} tensors"] * bool(full)
                    if served:
                        sync[mode + "_adapter"] = _differences(adapter, want_adapter)
                after = wrapkit.adapt(prepared).full_state_dict(rank0_only=False)
                sync["live_changed"] = _differences(after, live)
                out["syncs"].append(sync)
                if step == 0:
                    _train_step(prepared, accelerator, optimizer, inner)
    return out


def swift_sync(kind: str, cases: list[dict[str, Any]], patched: bool = True) -> list[dict[str, Any]]:
    """Each case (``family``; ``peft``: None, ``"lora"``, ``"lora-mts"``; ``served_lora``: the rollout serves the
    adapter, so the base weights go out once and then the adapter alone; ``unlisted``: the accelerator lists no
    prepared model) on accelerate's ``kind``."""
    return [{**case, **_case(kind, case, patched)} for case in cases]


__all__ = ["swift_sync", "SwiftClient", "SwiftEngine"]
