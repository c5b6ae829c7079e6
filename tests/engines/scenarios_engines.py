"""Scenarios on the shared workers for engines in other processes: the stand-in SGLang server of
``tests/engines/sglang_standin.py`` is fed from every backend, and what it then holds is compared with the model."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from wrapkit.cli._families import family_inputs, family_model
from wrapkit.cli._models import build, fill_adapters
from wrapkit.integrations.engines._engine_wire import call
from wrapkit.integrations.sglang import SGLangEngine


def _train_step(wm: Any, model: torch.nn.Module, lr: float = 0.1) -> None:
    inputs = family_inputs(model)
    # A reward model scores each sequence (one regression label per row); the others predict the next tokens.
    reward = type(wm.unwrap(keep_peft=False)).__name__.endswith("ForSequenceClassification")
    labels = torch.zeros(inputs["input_ids"].shape[0]) if reward else inputs["input_ids"]
    loss = wm(**{k: v.to(wm.device) for k, v in inputs.items()}, labels=labels.to(wm.device)).loss
    if wm.backend == "deepspeed":
        wm.module.backward(loss)
        wm.module.step()
        return
    loss.backward()
    with torch.no_grad():
        for p in wm.module.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None


def _engine(kind: str, url: str, port: int, name: str, timeout: float) -> Any:
    """The engine of ``kind`` (``"sglang"``, ``"vllm"``) at the stand-in ``url``, its group's store at ``port``."""
    if kind == "vllm":
        from wrapkit.integrations.vllm import VLLMEngine

        return VLLMEngine(url, master_port=port, backend="gloo", timeout=timeout, buffer_bytes=24 * 1024)
    return SGLangEngine(url, master_port=port, group_name=f"{name}-{port}", timeout=timeout)


def _split_model(tmp: str, family: str, split: str) -> tuple[Any, str]:
    """transformers' own split of ``family`` (seed 0): two pipeline stages (``split="pipeline"``), or the experts
    split over the ranks (``"experts"``); with the directory of the checkpoint it was loaded from."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from tests.adapters.scenarios_foreign import saved

    directory = saved(tmp, f"{family}-split", lambda: family_model(family, 0))
    config = DistributedConfig(pp_size=2) if split == "pipeline" else DistributedConfig(fsdp_size=2, ep_size=2)
    return wrapkit.adapt(AutoModelForCausalLM.from_pretrained(directory, distributed_config=config)), directory


def sync_to_standin(cases: list[dict[str, Any]], url: str, ports: list[int], dump_dir: str,
                    kind: str = "sglang") -> dict[str, Any]:
    """For each case (``spec``, ``family``, ``precision``, ``topology``, ``merge``; or ``split``): sync to the
    stand-in of ``kind``, train a step, sync again (a split model syncs once); after each sync the stand-in's
    weights against the model's full state dict."""
    out: dict[str, Any] = {}
    for case, port in zip(cases, ports, strict=True):
        model = family_model(case["family"], seed=0)
        if case.get("merge"):  # LoRA whose adapters change the weights once merged
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            model = fill_adapters(get_peft_model(model, config), seed=1)
        if case.get("split"):
            wm, _ = _split_model(dump_dir, case["family"], case["split"])
        else:
            wm = wrapkit.adapt(build(case["spec"], model=model, precision=case.get("precision", "fp32"),
                                     topology=case.get("topology", "flat")))
        engine = _engine(kind, url, port, f"wk-{case.get('spec', 'split')}", 60)
        engine.connect()
        syncs = []
        try:
            for step in range(1 if case.get("split") else 2):
                if step:
                    _train_step(wm, model)
                merge = bool(case.get("merge"))
                report = engine.sync(wm, bucket_bytes=16 * 1024, merge_adapters=merge)
                want = wm.full_state_dict(merge_adapters=merge)
                obs: dict[str, Any] = {"report": report._asdict()}
                if dist.get_rank() == 0:
                    path = os.path.join(dump_dir, f"{case.get('spec')}-{port}-{step}.pt")
                    obs["calls"] = call(url, "standin_dump", {"path": path}, 60)["calls"]
                    held = torch.load(path)
                    obs["wrong"] = [k for k, v in held.items() if k not in want or not torch.equal(
                        v, want[k].to(v.dtype))]
                    obs["compared"] = len(held)
                syncs.append(obs)
        finally:
            engine.close()
        out[repr(sorted(case.items()))] = syncs
        del wm, model
    return out


def sync_expecting_failure(url: str, port: int, connect_only: bool = False, kind: str = "sglang") -> list[str]:
    """A sync to an engine that refuses or is gone, then another: what each raised on this rank (every rank
    must raise alike, and the second call must not hang where the first left the group out of step)."""
    wm = wrapkit.adapt(build("fsdp2", model=family_model("llama", seed=0)))
    engine = _engine(kind, url, port, "wk-fail", 5)  # short: a refused join waits it out
    outcomes = []
    try:
        for _ in range(1 if connect_only else 2):
            try:
                if not outcomes:  # the second call goes on from wherever the first left the engine
                    engine.connect()
                if not connect_only:
                    engine.sync(wm, bucket_bytes=16 * 1024)
                outcomes.append("no error")
            except wrapkit.WrapkitError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        engine.close()
    return outcomes


def _scaled_norms(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v * 2 if "norm" in k else v for k, v in sd.items()}


def _halved_norms(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v / 2 if "norm" in k else v for k, v in sd.items()}


def _transposed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("q_proj", "q_t"): v.t() if "q_proj" in k else v for k, v in sd.items()}


def _untransposed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("q_t", "q_proj"): v.t() if "q_t" in k else v for k, v in sd.items()}


# Hub layouts a trainer gives its model (``set_hub_layout``): one that computes some Hub tensors (the norms,
# doubled), one that only moves elements (q_proj transposed, renamed).
_LAYOUTS = {"computed": (_scaled_norms, _halved_norms), "transposed": (_transposed, _untransposed)}


def vllm_refused_mid_update(spec: str, url: str, ports: list[int], positions: list[int | str]) -> dict[str, Any]:
    """For each chunk the vLLM stand-in refuses (``positions``: its index, negative from the last, or ``"middle"``),
    on a fresh port each: a sync of a Llama on ``spec`` (engine timeout 8 s), what it raised and when (wall clock,
    beside the stand-in's own time of refusal), then what a second sync without ``connect()`` raised. At the end,
    ``connect()`` on the first port again (its group may still be held by a chunk no one took) and a sync that
    the stand-in accepts."""
    import time

    from wrapkit.integrations.engines._engine_wire import call

    wm = wrapkit.adapt(build(spec, model=family_model("llama", seed=0)))
    out: dict[str, Any] = {"refusals": []}

    def mode(**behaviour: Any) -> None:
        if dist.get_rank() == 0:
            assert call(url, "standin_mode", {"family": "llama", **behaviour}, 60)["success"]
        dist.barrier()

    def attempt(engine: Any) -> tuple[str, float]:
        try:
            engine.sync(wm, bucket_bytes=16 * 1024)
            return "no error", time.time()
        except wrapkit.WrapkitError as exc:
            return f"{type(exc).__name__}: {exc}", time.time()

    for at, port in zip(positions, ports, strict=True):
        mode(refuse_chunk=at)
        engine = _engine("vllm", url, port, "wk-refused", 8)
        engine.connect()
        started = time.time()
        first, raised_at = attempt(engine)
        refused_at = call(url, "standin_dump", {}, 60)["refused_at"] if dist.get_rank() == 0 else None
        second, _ = attempt(engine)
        engine.close()
        out["refusals"].append({"at": at, "first": first, "seconds": raised_at - started, "raised_at": raised_at,
                                "refused_at": refused_at, "second": second})
    mode()
    engine = _engine("vllm", url, ports[0], "wk-refused", 8)
    t0 = time.time()
    try:
        engine.connect()
        out["reconnect_seconds"] = time.time() - t0
        out["after"] = attempt(engine)[0]
    finally:
        engine.close()
    return out


def failed_syncs(group: Any, url: str, kind: str = "sglang", connect_only: bool = False) -> tuple[list[Any], float]:
    """In the test's process: ``sync_expecting_failure`` on every rank of ``group``, what each rank raised and the
    seconds until all had; then the engine calls the failure left waiting are joined (``join_engine_threads``)."""
    import time

    from wrapkit.cli._workers import free_port

    t0 = time.monotonic()
    outcomes = group.run(sync_expecting_failure, url, free_port(), connect_only, kind, timeout=120)
    seconds = time.monotonic() - t0
    group.run(join_engine_threads, timeout=60)
    return outcomes, seconds


def join_engine_threads() -> None:
    """Wait for the engine calls a failure left waiting (a join of a group the engine refused ends by its own
    timeout): the next scenario on this worker then starts with the threads it had before."""
    import threading

    from wrapkit.integrations.engines._engine_wire import CALL_THREAD

    for thread in threading.enumerate():
        if thread.name == CALL_THREAD:
            thread.join(30)


def _through_vllm(source: Any, interface: str, transfer: Any, engine_model: torch.nn.Module | None,
                  buffer_bytes: int, want: Callable[[], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One ``send_weights()`` of ``source`` on every rank, received by ``engine_model`` (rank 0's transfer
    group); what it then holds against ``want()`` (called on every rank: it may be collective)."""
    from tests.engines import vllm_standin as vs

    meta = vs.metadata_of(source, interface)
    obs: dict[str, Any] = {"declared": len(meta), "owned": len(source.owned_names(dist.get_rank()))}
    if transfer is not None and engine_model is not None:
        told = [(m.name, str(m.dtype).removeprefix("torch."), list(m.shape)) for m in meta]
        box, thread = transfer.update(told, buffer_bytes, engine_model)
    chunks = vs.send(source, interface, transfer.trainer if transfer else None, buffer_bytes, transfer is not None)
    expected = want()
    if transfer is not None and engine_model is not None:
        thread.join(60)
        held = engine_model.state_dict()
        obs.update(error=box.get("error"), loaded=len(box.get("loaded", [])), chunks=chunks, compared=len(held),
                   dtypes=sorted({str(m.dtype) for m in meta}),
                   wrong=[k for k, v in held.items() if k not in expected
                          or not torch.equal(v, expected[k].to(v.dtype))])
    return obs


def sync_through_vllm_source(cases: list[dict[str, Any]], ports: list[int], buffer_bytes: int) -> dict[str, Any]:
    """For each case (``spec``, ``family``, ``precision``, ``topology``, ``interface``, ``wire``, ``keep``): a
    vLLM weight source fed through vLLM's send and receive (``tests/engines/vllm_standin.py``), then a training step and
    again; after each what the worker's model holds against the model's full state dict."""
    from tests.engines import vllm_standin as vs
    from wrapkit.integrations.vllm import weight_source

    out: dict[str, Any] = {}
    rank0 = dist.get_rank() == 0
    for case, port in zip(cases, ports, strict=True):
        model = family_model(case["family"], seed=0)
        merge = bool(case.get("merge"))
        if merge:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            model = fill_adapters(get_peft_model(model, config), seed=1)
        wm = wrapkit.adapt(build(case["spec"], model=model, precision=case.get("precision", "fp32"),
                                 topology=case.get("topology", "flat")))
        wire = getattr(torch, case["wire"]) if "wire" in case else None
        keep = (lambda name: "norm" in name) if case.get("keep") else None
        source = weight_source(wm, bucket_bytes=16 * 1024, dtype=wire, merge_adapters=merge, keep_dtype=keep)
        transfer = vs.TransferGroup(port) if rank0 else None
        engine_dtype = wire or (torch.bfloat16 if case.get("precision") == "bf16" else torch.float32)
        engine_model = family_model(case["family"], seed=1234).eval().to(engine_dtype) if rank0 else None
        syncs = []
        try:
            for step in range(2):
                if step:
                    _train_step(wm, model)
                syncs.append(_through_vllm(source, case.get("interface", "0.33"), transfer, engine_model,
                                           buffer_bytes, partial(wm.full_state_dict, merge_adapters=merge)))
        finally:
            if transfer is not None:
                transfer.close()
        out[repr(sorted(case.items()))] = syncs
        del wm, model, source
    return out


def vllm_source_from_split_model(tmp: str, split: str, port: int, buffer_bytes: int) -> dict[str, Any]:
    """``split``: ``"pipeline"`` (transformers' two stages, one per rank) or ``"experts"`` (Qwen3-MoE's experts
    split over the two ranks, the rest sharded): a vLLM source over it feeds a model loaded whole from another
    checkpoint, which must then hold the split model's checkpoint exactly."""
    from transformers import AutoModelForCausalLM

    from tests.adapters.scenarios_foreign import saved
    from tests.engines import vllm_standin as vs
    from wrapkit.integrations.vllm import weight_source

    name = "llama" if split == "pipeline" else "qwen3-moe"
    wm, directory = _split_model(tmp, name, split)
    other = saved(tmp, f"{name}-vllm-other", lambda: family_model(name, 1))
    source = weight_source(wm, bucket_bytes=16 * 1024)
    rank0 = dist.get_rank() == 0
    transfer = vs.TransferGroup(port) if rank0 else None
    engine_model = AutoModelForCausalLM.from_pretrained(other).eval() if rank0 else None
    try:
        obs = _through_vllm(source, "0.33", transfer, engine_model, buffer_bytes,
                            lambda: AutoModelForCausalLM.from_pretrained(directory).state_dict())
    finally:
        if transfer is not None:
            transfer.close()
    obs["backend"] = wm.backend
    return obs


def vllm_sender_that_stops() -> list[str]:
    """The sender's broadcast fails after three tensors: what each rank raised, then whether a collective
    afterwards still meets every rank (nothing left out of step)."""
    from tests.engines import vllm_standin as vs
    from wrapkit.integrations.vllm import weight_source

    wm = wrapkit.adapt(build("fsdp2", model=family_model("llama", seed=0)))
    source = weight_source(wm, bucket_bytes=16 * 1024)
    outcomes = []
    try:
        vs.send(source, "0.33", None, 2**30, dist.get_rank() == 0, stop_after=3)
        outcomes.append("no error")
    except Exception as exc:
        outcomes.append(f"{type(exc).__name__}: {exc}")
    outcomes.append(f"then {len(wm.full_state_dict(rank0_only=False))} tensors gathered")
    return outcomes


def _adapted(family: str) -> torch.nn.Module:
    """A PEFT model of ``family`` (seed 0, as the LoRA stand-in builds its base) with random LoRA matrices: on
    attention, and on the fused experts too where there are experts (PEFT's ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    from tests.exchange.scenarios_families import EXPERT_TARGETS

    experts = {"target_parameters": EXPERT_TARGETS} if "moe" in family else {}
    targets = ["q", "v"] if family == "t5" else ["q_proj", "v_proj"]  # T5 names its projections alone
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, **experts)
    return fill_adapters(get_peft_model(family_model(family, seed=0), config), seed=1)


def adapters_to_standins(cases: list[dict[str, Any]], urls: list[str], root: str) -> dict[str, Any]:
    """For each case (``engine``, ``spec``, ``family``, ``precision``): an adapter sync to every replica, a
    training step, another sync, and one from a new engine object (a restarted trainer); after each, what the
    replicas list and, in fp32, the first replica's logits for the served version against the model's own."""
    from wrapkit.integrations.engines._adapters import listed
    from wrapkit.integrations.vllm import VLLMEngine

    out: dict[str, Any] = {}
    for case in cases:
        model = _adapted(case["family"])
        wm = wrapkit.adapt(build(case["spec"], model=model, precision=case.get("precision", "fp32"),
                                 topology=case.get("topology", "flat")))
        name = f"{case['spec']}-{case['family']}"
        syncs = []
        for step in range(3):
            if step != 1:  # the third sync from a new engine object: it goes on after the versions listed
                engine: Any = VLLMEngine(urls, timeout=60) if case["engine"] == "vllm" else SGLangEngine(
                    urls, timeout=60, engine_ranks=2)
            if step == 1 and case["spec"] == "pipeline":  # a stage's loss is not the model's: new values instead
                fill_adapters(wm.unwrap(), seed=2 + dist.get_rank())
            elif step == 1:
                _train_step(wm, model)
            args = (wm, root) if case["engine"] == "vllm" else (wm,)
            report = engine.sync_adapters(*args, name=name)
            held = wm.full_state_dict()  # the model's values on rank 0, from any layout (pipeline stages too)
            obs: dict[str, Any] = {"report": report._asdict()}
            if dist.get_rank() == 0:
                obs["listed"] = [sorted(listed(url, 30) - {"base-model"}) for url in urls]
                obs["files"] = sorted(os.listdir(root)) if case["engine"] == "vllm" else []
                if case.get("precision", "fp32") == "fp32":
                    mine = _adapted(case["family"]).eval()
                    mine.load_state_dict(held)
                    with torch.no_grad():
                        ours = mine(**family_inputs(mine)).logits
                    path = os.path.join(root, f"logits-{name}-{step}.pt")
                    call(urls[0], "standin_logits", {"name": report.name, "path": path}, 60)
                    obs["logits_diff"] = float((torch.load(path) - ours).abs().max())
                    os.remove(path)
            syncs.append(obs)
        out[repr(sorted(case.items()))] = syncs
        del wm, model
    return out


def adapters_refused(engine_kind: str, urls: list[str], root: str, engine_ranks: int = 2) -> list[str]:
    """Two syncs to replicas of which the last refuses the load: what each raised on this rank."""
    from wrapkit.integrations.vllm import VLLMEngine

    wm = wrapkit.adapt(build("fsdp2", model=_adapted("llama")))
    engine: Any = (VLLMEngine(urls, timeout=10) if engine_kind == "vllm"
                   else SGLangEngine(urls, timeout=10, engine_ranks=engine_ranks))
    outcomes = []
    for _ in range(2):
        try:
            engine.sync_adapters(wm, root) if engine_kind == "vllm" else engine.sync_adapters(wm)
            outcomes.append("no error")
        except wrapkit.WrapkitError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


def deltas_through_standin(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For each case (``spec``, ``family``, ``precision``, ``topology``, ``wire``, ``keep`` (norms in fp32),
    ``merge``, ``lr``, ``fail_on``, ``drop``, ``dense_every``): four ``DeltaSync`` sends to vLLM's sparse
    receiver (``vllm_standin.SparseSender``), a training step before each but the first; after each, what the
    receiver holds against a dense stream."""
    from tests.engines import vllm_standin as vs
    from wrapkit.integrations.engines._delta import DeltaSync

    out: dict[str, Any] = {}
    for case in cases:
        if case["spec"] in _FRAMEWORKS:
            model = _FRAMEWORKS[case["spec"]](case)
        else:
            model = _adapted(case["family"]) if case.get("merge") else family_model(case["family"], seed=0)
            model = build(case["spec"], model=model, precision=case.get("precision", "fp32"),
                          topology=case.get("topology", "flat"))
        wm = wrapkit.adapt(model)
        wire = getattr(torch, case["wire"]) if case.get("wire") else None
        merge = bool(case.get("merge"))
        keep = (lambda n: "norm" in n) if case.get("keep") else None  # noqa: E731 (norms stay in fp32)
        if case.get("layout"):
            wm.set_hub_layout(*_LAYOUTS[case["layout"]])
        delta = DeltaSync(wm, dtype=wire, merge_adapters=merge, bucket_bytes=16 * 1024, keep_dtype=keep,
                          dense_every=case.get("dense_every"))
        rank0 = dist.get_rank() == 0
        transfer = vs.TransferGroup() if rank0 else None
        sender = vs.SparseSender(transfer, case.get("fail_on"), case.get("drop")) if transfer is not None else None
        syncs: list[dict[str, Any]] = []
        try:
            for step in range(4):
                if step and (case["spec"] == "pipeline" or case["spec"] in _FRAMEWORKS or case.get("nan")):
                    _moved(wm, step)  # a stage's loss is not the model's; the frameworks' own loops are not run
                elif step:
                    _train_step(wm, model, case.get("lr", 1e-4))
                if case.get("nan"):  # a NaN in one weight before the second sync, gone again before the fourth
                    _poisoned(wm, case["nan"], float("nan") if step in (1, 2) else 0.0)
                obs: dict[str, Any] = {}
                try:
                    obs["report"] = delta.send(sender)._asdict()
                except wrapkit.WrapkitError as exc:
                    obs["error"] = f"{type(exc).__name__}: {exc}"
                want = {n: t.clone() for b in wm.stream_full_parameters(16 * 1024, wire, merge, keep_dtype=keep)
                        for n, t in b.named_tensors()}
                if sender is not None:
                    held = sender.held
                    obs["wrong"] = sorted(n for n in want if n not in held or not torch.equal(held[n], want[n]))
                    obs["extra"] = sorted(set(held) - set(want))
                    obs["compared"] = len(want)
                obs["snapshot"] = delta.snapshot_bytes()
                syncs.append(obs)
        finally:
            if transfer is not None:
                transfer.close()
        out[repr(sorted(case.items()))] = syncs
        del wm, model
    return out


def _poisoned(wm: Any, name: str, value: float) -> None:
    """Set the first element of every rank's own part of each parameter whose name holds ``name``."""
    with torch.no_grad():
        for n, p in wm.unwrap().named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name in n and local.numel():
                local.view(-1)[0] = value


def _moved(wm: Any, step: int) -> None:
    """Move every ``7 + step``-th value of each rank's own part of every parameter (a DTensor's local shard);
    alike on every rank, so that replicas stay replicas, as training keeps them."""
    with torch.no_grad():
        for p in wm.unwrap().parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel():
                local.view(-1)[:: 7 + step].add_(0.01)


def _transformers_ep(case: dict[str, Any]) -> Any:
    """Qwen3-MoE with its experts split over two ranks beside FSDP2, as transformers makes it."""
    from tests.adapters.scenarios_foreign import _transformers_ep as split

    return split(case["tmp"])


def _titan_ep(case: dict[str, Any]) -> Any:
    """torchtitan's layout of experts, split by hand over an (efsdp, ep) mesh beside FSDP2 (four ranks)."""
    from tests.parallel.scenarios_experts import TitanMoE, _split_by_hand

    return _split_by_hand(TitanMoE(0))


def _megatron(case: dict[str, Any]) -> Any:
    """A Megatron-Core model split by tensor (``tp``) and pipeline (``pp``) parallelism, or its Qwen3-MoE-style
    mixture with the experts over ``ep`` ranks; its own Hub mapping (fused QKV and gate/up split)."""
    from tests.parallel.megatron_cpu import build as megatron_build
    from tests.parallel.megatron_cpu import build_mixture

    dtype = getattr(torch, case.get("dtype", "float32"))
    if case.get("ep"):
        return build_mixture(case["ep"], case.get("tp", 1), dtype)
    return megatron_build(case.get("style", "llama"), case.get("tp", 1), case.get("pp", 1), dtype)


# Models built by other frameworks' own code, by the case's spec.
_FRAMEWORKS: dict[str, Callable[[dict[str, Any]], Any]] = {"ep": _transformers_ep, "titan-ep": _titan_ep,
                                                           "megatron": _megatron}


def syncs_refused(spec: str, topology: str, root: str) -> list[str]:
    """What ``DeltaSync``, an adapter sync and SGLang's dense sync of a ``spec`` model on ``topology`` raise on
    this rank."""
    from wrapkit.integrations.vllm import DeltaSync, VLLMEngine

    wm = wrapkit.adapt(build(spec, model=_adapted("llama"), topology=topology))
    out = []
    dense = SGLangEngine("http://127.0.0.1:9", master_port=9)  # refused before it needs connect()
    for attempt in (lambda: DeltaSync(wm), lambda: VLLMEngine("http://127.0.0.1:9").sync_adapters(wm, root),
                    lambda: dense.sync(wm)):
        try:
            attempt()
            out.append("no error")
        except wrapkit.WrapkitError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out
