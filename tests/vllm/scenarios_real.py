"""Scenarios against a real vLLM server (run on every rank of the shared two-rank group): wrapkit's ``VLLMEngine``
over the gloo backend its vLLM plugin registers, checked by what the server generates."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.vllm.server import compared, greedy
from wrapkit.cli._models import build
from wrapkit.integrations.vllm import VLLMEngine

PROMPTS = [[1, 5, 9, 13], [7, 3, 2, 8, 100], [200, 17]]
NEW_TOKENS = 6


def served(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    """The server's greedy tokens and their log-probabilities for each prompt (token ids in, token ids out)."""
    out = []
    for prompt in PROMPTS:
        # ignore_eos: the oracle's generate() is told the same, so that neither stops at a token the other passes.
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            choice = json.load(answer)["choices"][0]
        out.append((list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]))
    return out


def own(wm: Any) -> list[tuple[list[int], list[float]]]:
    """The trained model's own greedy tokens and their log-probabilities (collective: every rank)."""
    with torch.no_grad(), wm.generation() as m:
        return greedy(m, PROMPTS, NEW_TOKENS)


def _compare(wm: Any, url: str, model: str) -> dict[str, Any] | None:
    """Tokens equal and the largest log-probability difference, on rank 0 (None elsewhere)."""
    mine = own(wm)
    if dist.get_rank() != 0:
        return None
    return compared(mine, served(url, model))


def _step(wm: Any, outer: Any, spec: str) -> None:
    """A training step with a large learning rate, so that the server is visibly behind after it. Tensor
    parallelism: every weight scaled alike, since its recipe leaves the replicated norms' gradient all-reduce to its
    trainer; pipeline stages too, since a stage's forward is not the model's loss (each stage scales its own);
    DeepSpeed: the engine's own backward and step, its learning rate raised."""
    if spec in ("tp", "pipeline"):
        with torch.no_grad():
            for p in outer.parameters():
                p.mul_(1.25).add_(0.01)
        return
    ids = torch.tensor([[1, 5, 9, 13, 20, 30, 40, 50]])
    loss = wm(input_ids=ids, labels=ids).loss
    if wm.backend == "deepspeed":
        for group in outer.optimizer.param_groups:
            group["lr"] = 0.05
        outer.backward(loss)
        outer.step()
        return
    optimizer = torch.optim.SGD([p for p in outer.parameters() if p.requires_grad], lr=2.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def sync_step_sync(url: str, model: str, port: int, specs: list[str]) -> dict[str, Any]:
    """For each stack (``"zero3"``, ``"ddp>peft"``: LoRA, synced merged): the server's model loaded from ``model``
    too, wrapped as ``spec``; a sync, a step (the server is now behind: the comparison must fail), a sync again.
    Each comparison against the trained model's own greedy tokens and log-probabilities."""
    from transformers import AutoModelForCausalLM

    engine = VLLMEngine(url, backend="gloo", master_port=port, timeout=60)
    engine.connect()
    out: dict[str, Any] = {}
    for spec in specs:
        outer = build(spec, model=AutoModelForCausalLM.from_pretrained(model))
        wm = wrapkit.adapt(outer)
        merge = "peft" in spec
        first = engine.sync(wm, merge_adapters=merge)
        synced = _compare(wm, url, model)
        _step(wm, outer, spec)
        behind = _compare(wm, url, model)
        second = engine.sync(wm, merge_adapters=merge)
        again = _compare(wm, url, model)
        out[spec] = {"synced": synced, "behind": behind, "again": again, "tensors": first.tensors,
                     "seconds": [first.seconds, second.seconds], "version": second.version, "backend": wm.backend}
    engine.close()
    return out


def _llama(model: str, **changes: Any) -> Any:
    """The server's Llama, or one whose config differs by ``changes`` (another vocabulary, fewer layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not changes:
        return LlamaForCausalLM.from_pretrained(model)
    config = LlamaConfig.from_pretrained(model)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(1)
    return LlamaForCausalLM(config)


def failures(url: str, model: str, port: int) -> dict[str, Any]:
    """What a sync of a model the server cannot take does (another vocabulary: a tensor that does not fit; fewer
    layers: layers left without weights), on each rank: the error and how long it took, whether the server was left
    paused, what the right model's next sync does, and whether the server then generates as that model."""
    import time

    engine = VLLMEngine(url, backend="gloo", master_port=port, timeout=30)
    out: dict[str, Any] = {}

    def attempt(key: str, wrong: dict[str, Any], spec: str = "ddp") -> None:
        wm = wrapkit.adapt(build(spec, model=_llama(model, **wrong)))
        if not engine.connected:
            engine.connect()
        t0 = time.perf_counter()
        try:
            engine.sync(wm)
            out[key] = {"error": None}
        except wrapkit.WrapkitError as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        out[key]["seconds"] = time.perf_counter() - t0

    attempt("unmerged adapters", {}, "ddp>peft")  # refused before the server is paused
    if dist.get_rank() == 0:
        with urllib.request.urlopen(f"{url}/is_paused", timeout=30) as answer:
            out["paused after unmerged"] = json.load(answer).get("is_paused")
    attempt("vocabulary", {"vocab_size": 264})
    if dist.get_rank() == 0:
        with urllib.request.urlopen(f"{url}/is_paused", timeout=30) as answer:
            out["paused after refusal"] = json.load(answer).get("is_paused")
    attempt("right after", {})
    attempt("right again", {})
    right = wrapkit.adapt(build("ddp", model=_llama(model)))
    out["generates"] = _compare(right, url, model)
    attempt("more layers", {"num_hidden_layers": 3})
    attempt("fewer layers", {"num_hidden_layers": 1})
    attempt("right at last", {})
    out["generates at last"] = _compare(right, url, model)
    engine.close()  # its gloo group, on these shared workers
    return out


def killed_mid_sync(url: str, model: str, port: int, server_pid: int) -> dict[str, Any]:
    """The server killed (SIGKILL to its process group: API server and worker) as the third chunk of a sync is about
    to be sent: the error on each rank, how long it took, and whether the engine says to connect again."""
    import os
    import signal
    import time

    engine = VLLMEngine(url, backend="gloo", master_port=port, timeout=60, buffer_bytes=24 * 1024)
    engine.connect()
    wm = wrapkit.adapt(build("fsdp2", model=_llama(model)))
    engine.sync(wm)  # a first sync in full
    if dist.get_rank() == 0:
        send, sent = engine._dense._send, [0]

        def killing(parts: Any, box: Any) -> Any:
            sent[0] += 1
            if sent[0] == 3:
                os.killpg(server_pid, signal.SIGKILL)
            return send(parts, box)

        engine._dense._send = killing
    t0 = time.perf_counter()
    out: dict[str, Any] = {"error": None}
    try:
        engine.sync(wm)
    except wrapkit.WrapkitError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - t0
    out["connected"] = engine.connected
    return out


def adapters(url: str, model: str, directory: str, spec: str) -> dict[str, Any]:
    """A LoRA adapter alone, through vLLM's runtime LoRA routes (``sync_adapters``: saved under ``directory``,
    loaded as ``policy-vN``): a sync, a step, a sync again. Each version is compared with the trained PEFT
    model's own generation (adapters unmerged); between them the served version is behind."""
    from peft import LoraConfig, get_peft_model

    from wrapkit.cli._models import fill_adapters

    peft = get_peft_model(_llama(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    fill_adapters(peft, seed=1)
    with torch.no_grad():  # small enough that the step below moves the tokens, not so large that they saturate
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    outer = build(spec, model=peft)
    wm = wrapkit.adapt(outer)
    engine = VLLMEngine(url, timeout=60)
    first = engine.sync_adapters(wm, directory, name="policy")
    synced = _compare(wm, url, first.name)
    _step(wm, outer, spec)
    behind = _compare(wm, url, first.name)
    second = engine.sync_adapters(wm, directory, name="policy")
    again = _compare(wm, url, second.name)
    base = _compare(wm, url, model)  # the base model, served beside the adapter, is not the trained one
    return {"synced": synced, "behind": behind, "again": again, "base": base, "names": [first.name, second.name],
            "unloaded": second.unloaded, "tensors": first.tensors, "seconds": [first.seconds, second.seconds]}


def _moved(wm: Any, step: int) -> None:
    """Every ``7 + step``-th value of each rank's own part of every parameter moved, alike on every rank (replicas
    stay replicas): a step that changes a seventh of the values."""
    with torch.no_grad():
        for p in wm.unwrap().parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel():
                local.view(-1)[:: 7 + step].add_(0.05)


def deltas(url: str, model: str, port: int, specs: list[str]) -> dict[str, Any]:
    """``DeltaSync`` into a server whose backend is ``sparse_gloo`` (``delta.send(engine)``): a dense first round, then
    two sparse rounds after changing a seventh of the values; after each, the server against the model."""
    from wrapkit.integrations.vllm import DeltaSync

    engine = VLLMEngine(url, backend="gloo", master_port=port, timeout=60)
    engine.connect()
    out: dict[str, Any] = {}
    for spec in specs:
        wm = wrapkit.adapt(build(spec, model=_llama(model)))
        delta = DeltaSync(wm, dense_every=None)
        rounds = []
        for step in range(3):
            if step:
                _moved(wm, step)
            behind = _compare(wm, url, model) if step else None
            report = delta.send(engine)
            rounds.append({"report": report._asdict(), "behind": behind, "synced": _compare(wm, url, model)})
        out[spec] = rounds
    engine.close()
    return out
