"""Scenarios for ``stream_full_parameters`` and the ``load_into`` consumer.

Each case wraps a tiny Llama (or a LoRA model of it), streams it in small buckets into a plain
transformers model through ``wrapkit.integrations.vllm.load_into``, and reports what a test
checks: the receiver's weights against ``full_state_dict()``, the collectives each bucket made,
the bucket sizes and dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import wrapkit
from tests.exchange.scenarios_state import _peft_with_trained_lora
from wrapkit._registry import as_adapter
from wrapkit.cli._models import PRECISIONS, build, tiny_llama
from wrapkit.integrations.vllm import load_into

TOKENS = torch.arange(16).reshape(2, 8) % 128
# Small enough that the tiny model takes several buckets: the embedding alone is 16 KiB in fp32.
BUCKET = 20_000


def _receiver(merge: bool, peft: bool) -> torch.nn.Module:
    """A model of the streamed names: the base Llama, or the PEFT model itself (adapters unmerged)."""
    return build("peft", seed=99) if peft and not merge else tiny_llama(99)


def _train_step(wm: Any) -> None:
    """One optimizer step, as a trainer makes before it syncs: ZeRO-3 keeps small parameters
    gathered from then on, and a 16-bit engine's weights are its fp32 masters rounded."""
    module = wm.module
    if wm.backend == "deepspeed":
        loss = module(input_ids=TOKENS, labels=TOKENS).loss
        module.backward(loss)
        module.step()
        return
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    module(input_ids=TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    opt.zero_grad()


def stream_case(spec: str, precision: str = "fp32", dtype: str | None = None, merge: bool = False,
                topology: str = "flat", trained: bool = False, dst_rank: int | None = None,
                keep_norms: bool = False) -> dict[str, Any]:
    peft = "peft" in spec
    backend = spec.split(">")[0]
    if peft:
        model = _peft_with_trained_lora()
        if backend != "peft":
            model = build(backend, model=model, precision=precision, topology=topology)
    else:
        model = build(spec, seed=3, precision=precision, topology=topology)
    wm = wrapkit.adapt(model)
    if trained:
        _train_step(wm)
    want = wm.full_state_dict(rank0_only=False, merge_adapters=merge)
    if wm.zero_stage == 3 and not trained:
        # Every parameter of the tiny model is under ZeRO-3's persistence threshold, so ZeRO-3 keeps
        # them gathered; released, they stand for the large ones that a real model streams.
        wm.module.empty_partition_cache()
    # Collectives counted on the default group, the model's, and the ones its parameters name.
    counted = {}
    if dist.is_initialized():
        first = next(iter(wm.unwrap().parameters()))
        # A DTensor's mesh may hold other group objects (of the same ranks) than the FSDP2 state's.
        mesh = getattr(first, "device_mesh", None)
        mesh_groups = [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else []
        for g in (dist.distributed_c10d._get_default_group(), as_adapter(wm).process_group(),
                  getattr(first, "ds_process_group", None), *mesh_groups):
            if g is not None:
                counted[id(g)] = g

    def seq() -> int:
        return int(sum(g._get_sequence_number_for_group() for g in counted.values()))

    out_dtype = PRECISIONS[dtype] if dtype is not None else None
    keep = (lambda name: "norm" in name) if keep_norms else None
    receiver = _receiver(merge, peft)
    if out_dtype is not None:
        receiver.to(out_dtype)
    obs: dict[str, Any] = {"collectives": [], "sizes": [], "entries": {}, "views": True}
    start = seq()
    buckets = []

    def watched() -> Any:
        nonlocal start
        for bucket in wm.stream_full_parameters(BUCKET, out_dtype, merge, keep_dtype=keep, dst_rank=dst_rank):
            obs["collectives"].append(seq() - start)
            obs["sizes"].append(bucket.flat.numel())
            obs["views"] &= all(t.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
                                for _, t in bucket.named_tensors())
            for e in bucket.entries:
                obs["entries"][e.name] = str(e.dtype)
            buckets.append(len(bucket.entries))
            yield bucket
            start = seq()
        obs["after_last"] = seq() - start

    obs["loaded"] = load_into(receiver, watched())
    got = receiver.state_dict()
    diffs = {}
    for name, dt in obs["entries"].items():
        ref = want[name].to(getattr(torch, dt.removeprefix("torch."))).to(got[name].dtype)
        diffs[name] = bool(torch.equal(got[name], ref))
    obs["equal"] = diffs
    obs["want_params"] = sorted(n for n, _ in _named_params(wm, merge))
    obs["buckets"] = len(buckets)
    obs["rank"] = dist.get_rank() if dist.is_initialized() else 0
    return obs


def _named_params(wm: Any, merge: bool) -> list[tuple[str, Any]]:
    """The names a stream must give: ``named_full_parameters()``'s, or the merged model's."""
    if merge:
        return [(n, None) for n, _ in tiny_llama(0).named_parameters()]
    return [(n, None) for n, _ in wm.named_full_parameters()]


def stream_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``stream_case``s in one call, keyed by their arguments."""
    return {repr(sorted(c.items())): stream_case(**c) for c in cases}


def stream_view() -> dict[str, Any]:
    """The PEFT reference view streams the base model's weights under the base names."""
    wm = wrapkit.adapt(build("zero3", model=_peft_with_trained_lora()))
    view = wrapkit.prepare_reference(wm, None)
    want = view.full_state_dict(rank0_only=False)
    receiver = tiny_llama(99)
    loaded = load_into(receiver, view.stream_full_parameters(BUCKET))
    got = receiver.state_dict()
    return {"names": sorted(loaded) == sorted(want), "equal": all(torch.equal(got[n], want[n]) for n in want)}


def stream_refusals() -> dict[str, Any]:
    """Bad arguments and mismatched calls: raised on every rank alike, nothing gathered."""
    wm = wrapkit.adapt(build("fsdp2"))
    out: dict[str, Any] = {}
    bad: list[dict[str, Any]] = [{"bucket_bytes": 0}, {"dtype": torch.int8}, {"dst_rank": 7},
                                 {"keep_dtype": "norm"}, {"bucket_bytes": 1 << 20 if dist.get_rank() else 1 << 21}]
    for i, kwargs in enumerate(bad):
        try:
            list(wm.stream_full_parameters(**kwargs))
            out[str(i)] = "no error"
        except wrapkit.WrapkitError as exc:
            out[str(i)] = f"{type(exc).__name__}: {exc}"
    try:
        load_into(tiny_llama(0).to(torch.bfloat16).model, wm.stream_full_parameters(1 << 30))
        out["wrong_receiver"] = "no error"
    except wrapkit.StateDictError as exc:
        out["wrong_receiver"] = str(exc)
    return out


# -- sleep / wake ----------------------------------------------------------------------------
def _storages(state: list[tuple[str, torch.Tensor]]) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in state if t.numel()}


def sleep_case(spec: str, level: int, precision: str = "fp32", topology: str = "flat",
               steps: int = 3, baselines: dict[Any, list[float]] | None = None) -> dict[str, Any]:
    """Train ``steps`` steps twice from the same weights, once with a sleep/wake cycle in every step
    (level 1: between backward and step, so the gradients must come back; level 2: after the step),
    and report both runs' losses and what sleep moved. ``baselines`` keeps the run without cycles
    for the next level of the same model (it does not depend on the level)."""
    obs: dict[str, Any] = {"losses": {}, "moved_all": [], "grads_after_sleep": [], "reports": []}
    plain_run = (spec, precision, topology, steps)
    known = None if baselines is None else baselines.get(plain_run)
    if known is not None:
        obs["losses"]["False"] = known
    for cycle in (True,) if known is not None else (False, True):
        wm = wrapkit.adapt(build(spec, seed=5, precision=precision, topology=topology))
        engine = wm.backend == "deepspeed"
        opt = None if engine else torch.optim.AdamW([p for p in wm.module.parameters() if p.requires_grad], lr=1e-2)
        losses = []

        for _ in range(steps):
            out = wm(input_ids=TOKENS, labels=TOKENS)
            losses.append(float(out.loss))
            if engine:
                wm.module.backward(out.loss)
            else:
                out.loss.backward()
            if cycle and level == 1:
                _nap(wm, opt, level, obs)
            if engine:
                wm.module.step()
            else:
                assert opt is not None
                opt.step()
            if cycle and level == 2:
                _nap(wm, opt, level, obs)
            if not engine:
                assert opt is not None
                opt.zero_grad(set_to_none=True)
        obs["losses"][str(cycle)] = losses
        obs["device_after"] = str(wm.device)
    if baselines is not None:
        baselines[plain_run] = obs["losses"]["False"]
    return obs


def _nap(wm: Any, opt: Any, level: int, obs: dict[str, Any]) -> None:
    """One sleep/wake cycle, recording what sleep moved."""
    from wrapkit.sync.sleeping import training_state

    below = as_adapter(wm)
    # The old storages are held, so that no new tensor can be put at one of their addresses.
    held = [t.untyped_storage() for _, t in training_state(below, opt) if t.numel()]
    before = {st.data_ptr() for st in held}
    report = wm.sleep(opt, level=level)
    asleep = training_state(below, opt)
    obs["reports"].append(report._asdict())
    obs["moved_all"].append(not (before & _storages(asleep)))
    obs["kept"] = sorted({what for what, t in asleep if t.numel() and t.untyped_storage().data_ptr() in before})
    obs["grads_after_sleep"].append(sum(1 for p in below.placement.frozen_parameters() if p.grad is not None))
    obs["on_cpu"] = all(t.device.type == "cpu" for _, t in asleep)
    wm.wake()


def sleep_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    baselines: dict[Any, list[float]] = {}
    for c in cases:
        try:
            out[repr(sorted(c.items()))] = sleep_case(**c, baselines=baselines)
        except wrapkit.WrapkitError as exc:
            out[repr(sorted(c.items()))] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def sleep_leaves_nothing_behind(strategy: str) -> dict[str, Any]:
    """FSDP1 (use_orig_params) under ``strategy``, after a training step: the tensors that still use a
    storage the model's training state had before ``sleep()`` (its old storages are held meanwhile, so
    no new tensor can take one of their addresses), then the losses of two more steps after ``wake()``
    against a twin that never slept."""
    import gc

    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    from wrapkit.sync.sleeping import training_state

    losses: dict[str, list[float]] = {}
    stale: list[str] = []
    for nap in (False, True):
        fsdp = FullyShardedDataParallel(tiny_llama(seed=3), device_id=torch.device("cpu"), use_orig_params=True,
                                        sharding_strategy=ShardingStrategy[strategy])
        wm = wrapkit.adapt(fsdp)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        run = []
        for step in range(3):
            loss = fsdp(input_ids=TOKENS, labels=TOKENS).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            run.append(float(loss))
            if nap and step == 0:
                held = [t.untyped_storage() for _, t in training_state(as_adapter(wm), opt) if t.numel()]
                before = {st.data_ptr() for st in held}
                wm.sleep(opt)
                gc.collect()
                for obj in gc.get_objects():
                    if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter) \
                            and obj.numel() and obj.untyped_storage().data_ptr() in before:
                        stale.append(f"{type(obj).__name__}{tuple(obj.shape)}")
                wm.wake()
                del held
        losses[str(nap)] = run
    return {"stale": stale, "losses": losses}
