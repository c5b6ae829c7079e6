"""TRL's own ``VLLMGeneration.sync_weights()`` on models prepared by accelerate (run on every rank of the shared
two-rank group), in server mode (a recording client in place of TRL's ``VLLMClient``) and colocate mode (a
recording engine whose ``load_weights`` keeps what it is given), against the Hub's layout of the same weights:
an unsharded twin's ``save_pretrained``, after PEFT's ``merge_and_unload()`` where there are adapters."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.exchange.scenarios_families import _differences, _files
from tests.integrations import accelerate_cpu
from wrapkit.cli._families import family_inputs, family_model


class RecordingClient:
    """TRL's ``VLLMClient`` as ``sync_weights`` uses it: what each update sent, checked against the metadata
    announced for it (the server sizes its buffers from that)."""

    def __init__(self) -> None:
        self.updates: list[dict[str, torch.Tensor]] = []
        self.problems: list[str] = []
        self.resets = 0

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]], params: Any) -> None:
        got = {name: t.detach().to("cpu", copy=True) for name, t in params}
        sent = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in got.items()]
        announced = [tuple(m) for m in metadata]
        if [tuple(m) for m in sent] != announced:
            at = next(i for i in range(len(sent) + 1) if i == len(sent) or i == len(announced)
                      or tuple(sent[i]) != announced[i])
            self.problems.append(f"metadata of {len(announced)} tensors, {len(sent)} sent; first differing at {at}")
        self.updates.append(got)

    def reset_prefix_cache(self) -> None:
        self.resets += 1


class _Model:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        for name, t in weights:
            self.loaded[name] = t.detach().to("cpu", copy=True)


class RecordingLLM:
    """vLLM's in-process ``LLM`` as colocate mode reaches it: ``llm_engine.model_executor.driver_worker
    .model_runner.model.load_weights``."""

    def __init__(self) -> None:
        self.model = _Model()
        runner = type("Runner", (), {"model": self.model})()
        worker = type("Worker", (), {"model_runner": runner})()
        executor = type("Executor", (), {"driver_worker": worker})()
        self.llm_engine = type("Engine", (), {"model_executor": executor})()
        self.resets = 0

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def take(self) -> dict[str, torch.Tensor]:
        out, self.model.loaded = self.model.loaded, {}
        return out


def _generation(model: torch.nn.Module, accelerator: Any, mode: str) -> Any:
    """TRL's ``VLLMGeneration`` as GRPO builds it (with the model before ``prepare``), its engine a recorder."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gen = VLLMGeneration.__new__(VLLMGeneration)
    gen.model, gen.accelerator, gen._dist, gen.mode = model, accelerator, DistributedBackend(accelerator), mode
    gen.enable_sleep_mode, gen._weight_metadata = False, None
    if mode == "server" and accelerator.is_main_process:
        gen.vllm_client = RecordingClient()
    if mode == "colocate":
        gen.llm = RecordingLLM()
    return gen


def _peft(model: torch.nn.Module, kind: str | None, seed: int) -> torch.nn.Module:
    if kind is None:
        return model
    from peft import LoraConfig, get_peft_model

    extra = {"modules_to_save": ["lm_head"]} if kind == "lora-mts" else {}
    out: torch.nn.Module = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B non-zero (fresh LoRA merges to nothing), the head's copy apart from the original
        for name, p in out.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return out


def _oracle(case: dict[str, Any], template: torch.nn.Module, live: dict[str, torch.Tensor],
            merge: bool = True) -> dict[str, torch.Tensor]:
    """The Hub's layout of ``live`` (the policy's full state dict): an unsharded twin (a copy of ``template``, built
    before DeepSpeed's ZeRO-3 set-up would have partitioned it) loaded with it, merged by PEFT where it has
    adapters (the base model alone without ``merge``), saved by transformers. Computed on rank 0, given to every
    rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        twin: Any = copy.deepcopy(template)
        twin.load_state_dict(live)
        if case.get("peft"):
            twin = twin.merge_and_unload() if merge else twin.unload()
        root = tempfile.mkdtemp()
        try:
            twin.save_pretrained(root)
            box[0] = _files(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def _train_step(prepared: Any, accelerator: Any, optimizer: Any, inner: torch.nn.Module) -> None:
    inputs = {k: v.to(accelerator.device) for k, v in family_inputs(inner).items()}
    loss = prepared(**inputs, labels=inputs["input_ids"]).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


# Layouts accelerate does not prepare, which TRL's sync has no branch for: the model is built split, and TRL's
# helper is handed it as it is.
SPLITS = ("tp", "pipeline")


def _split(kind: str, family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``family`` (seed 0) split as ``kind`` says, and its unsharded twin."""
    template = family_model(family, 0)
    if kind == "tp":
        from wrapkit.cli._models import build

        return build("tp", model=family_model(family, 0)), template
    from tests.engines.scenarios_engines import _split_model
    from tests.exchange.scenarios_families import _shared_root

    with _shared_root() as root:
        wm, _ = _split_model(root, family, "pipeline")
    return wm.module, template


def _case(kind: str, case: dict[str, Any], patched: bool) -> dict[str, Any]:
    from wrapkit.integrations.trl import patch_trl

    out: dict[str, Any] = {"rank": dist.get_rank(), "syncs": []}
    with accelerate_cpu.clean_state():
        if kind in SPLITS:
            accelerator = accelerate_cpu.accelerator("ddp")
            prepared, template = _split(kind, case["family"])
            model = prepared
            gens = {mode: _generation(model, accelerator, mode) for mode in ("server", "colocate")}
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        else:
            model = family_model(case["family"], 0)
            layers = list(model._no_split_modules or [])  # accelerate's FSDP units: the family's blocks
            model = _peft(model, case.get("peft"), 0)
            template = copy.deepcopy(model)
            # FSDP1 flattens frozen and trained parameters together only with use_orig_params (PEFT's set-up).
            settings: dict[str, Any] = {"use_orig_params": True} if case.get("peft") and kind == "fsdp" else {}
            if kind.startswith("zero") and getattr(model.config, "hidden_size", None) is None:
                settings["hidden"] = model.config.get_text_config().hidden_size
            accelerator = accelerate_cpu.accelerator(kind, layers=layers, **settings)
            gens = {mode: _generation(model, accelerator, mode) for mode in ("server", "colocate")}
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
            prepared, optimizer = accelerator.prepare(model, optimizer)
            if case.get("unlisted"):
                # A trainer that wrapped the model by itself, or an accelerator that keeps no list: the helper
                # holds the module inside the wrapper and nothing names the wrapper.
                accelerator._models.clear()
        patch = patch_trl() if patched else None
        try:
            for step in range(2):  # a sync before any forward, a training step, a sync again
                live = wrapkit.adapt(prepared).full_state_dict(rank0_only=False)
                want = _oracle(case, template, live)
                sync: dict[str, Any] = {}
                for mode, gen in gens.items():
                    try:
                        gen.sync_weights()
                    except Exception as exc:  # noqa: BLE001 - TRL's own sync, unpatched, raises on some
                        sync[mode] = [f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"]
                        continue
                    got = gen.llm.take() if mode == "colocate" else (
                        gen.vllm_client.updates[-1] if accelerator.is_main_process else None)
                    sync[mode] = None if got is None else _differences(got, want)
                    if mode == "server" and accelerator.is_main_process:
                        sync["server_metadata"] = gen.vllm_client.problems
                after = wrapkit.adapt(prepared).full_state_dict(rank0_only=False)
                sync["live_changed"] = _differences(after, live)
                out["syncs"].append(sync)
                if step == 0 and kind in SPLITS:
                    # A step's change, the same on every rank: a stage trains under its schedule, and the tensor-
                    # parallel recipe leaves the all-reduce of a replicated norm's partial gradients to its trainer.
                    with torch.no_grad():
                        for p in prepared.parameters():
                            p.mul_(1.5).add_(0.01)
                elif step == 0:
                    try:
                        _train_step(prepared, accelerator, optimizer, model)
                    except Exception as exc:  # noqa: BLE001
                        out["train"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                        traceback.print_exc()
                        break
        finally:
            if patch is not None:
                patch.undo()
    return out


def trl_sync(kind: str, cases: list[dict[str, Any]], patched: bool = True) -> list[dict[str, Any]]:
    """Each case (``family``, ``peft``: None, ``"lora"`` or ``"lora-mts"``) on accelerate's ``kind``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return [{**case, **_case(kind, case, patched)} for case in cases]


def table(obs: list[dict[str, Any]]) -> str:
    """One line per case: what went wrong, or ok (for the closing figures)."""
    lines = []
    for o in obs:
        bad = [f"{mode}: {d[:2]}" for s in o["syncs"] for mode, d in s.items() if d]
        lines.append(f"{o['family']}/{o.get('peft')}: {o.get('train', '')} {bad[:3] or 'ok'}")
    return "\n".join(lines)


__all__ = ["trl_sync", "table", "RecordingClient", "RecordingLLM"]
