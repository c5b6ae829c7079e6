"""Weight sync to an inference engine: ``stream_full_parameters`` against the floor and the usual
ways, on ZeRO-3, FSDP1, FSDP2 and tensor parallelism, two gloo ranks, at two model sizes, timed
alternately in one run.

* **stream vs bare all-gather** (goal: at least 0.8 of its bandwidth): iterating the buckets
  against bare ``all_gather_into_tensor`` calls moving the same bytes in the same bucket-sized
  pieces, the least any bucketed transfer can cost.
* **vs named_full_parameters** and **vs TRL per-tensor** (goal: not slower): the weights end in
  a receiving model (the stand-in for vLLM's ``load_weights``) through ``load_into`` of the
  stream, against ``named_full_parameters()`` one tensor at a time, and against the per-tensor
  loop TRL runs (ZeRO-3: ``GatheredParameters`` of one parameter, FSDP1: ``summon_full_params``
  of one unit, FSDP2: ``full_tensor()`` of one parameter; tensor parallelism, which TRL does not
  sync, the same ``full_tensor()`` loop over the split layers), each tensor loaded as it comes.
  The ratio there is the stream's speed-up.
* **sleep+wake**: one ``sleep()`` and ``wake()`` of the whole training state (parameters and AdamW's
  moments after a step), against copying the same tensors to fresh memory and back by hand (goal:
  at most 1.5x). On a machine without an accelerator both are host copies; DeepSpeed's own
  offload does nothing when the engine already lives on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from _common import barrier_timed, median, print_rows, row, two_ranks

NAME = "weight_sync"
GOAL_BANDWIDTH = 0.8
GOAL_CYCLE = 1.5
SIZES = {"M": 512, "L": 1024}  # hidden size of an 8-layer Llama (vocab 1024): 75 MB and 290 MB in fp32
BUCKET = 32 * 2**20


def _load_one(receiver: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
    with torch.no_grad():
        receiver[name].copy_(t)


def _times(backend: str, hidden: int, reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit._gather import all_gather_into
    from wrapkit._registry import as_adapter
    from wrapkit.cli._models import build, tiny_llama
    from wrapkit.integrations.vllm import load_into
    from wrapkit.sync.sleeping import training_state

    wm = wrapkit.adapt(build(backend, model=tiny_llama(0, layers=8, hidden=hidden, vocab=1024)))
    if wm.zero_stage == 3:
        wm.module.empty_partition_cache()  # nothing kept gathered between steps: every byte is sent
    target = tiny_llama(1, layers=8, hidden=hidden, vocab=1024)
    receiver = dict(target.named_parameters())
    group = as_adapter(wm).process_group()
    world = dist.get_world_size(group)
    total = as_adapter(wm).gatherer.full_bytes()
    pieces = [min(BUCKET, total - start) for start in range(0, total, BUCKET)]
    sends = [torch.empty(-(-n // (4 * world)), dtype=torch.float32) for n in pieces]

    def bare() -> None:
        for send in sends:
            recv = torch.empty(send.numel() * world, dtype=send.dtype)
            all_gather_into(recv, send, group=group)

    def stream() -> None:
        for _ in wm.stream_full_parameters(BUCKET):
            pass

    def stream_load() -> None:
        load_into(target, wm.stream_full_parameters(BUCKET))

    def named() -> None:
        for name, t in wm.named_full_parameters():
            _load_one(receiver, name, t)

    def trl() -> None:
        from wrapkit._names import canonical_name

        if backend == "zero3":
            import deepspeed

            for name, p in wm.unwrap().named_parameters():
                with deepspeed.zero.GatheredParameters([p]):
                    _load_one(receiver, canonical_name(name), p.data)
        elif backend == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel

            units = [(path, m) for path, m in wm.module.named_modules() if isinstance(m, FullyShardedDataParallel)]
            for path, unit in units:
                with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
                    for name, p in unit.named_parameters():
                        if name.count("_fsdp_wrapped_module") == 1:  # this unit's own, not a nested unit's
                            _load_one(receiver, canonical_name(f"{path}.{name}" if path else name), p.data)
        else:
            for name, p in wm.unwrap().named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # TP: the layers the plan left alone
                _load_one(receiver, canonical_name(name), full)

    # sleep() + wake() of the whole training state (AdamW's moments made by one step), against copying
    # the same bytes to fresh memory and back by hand.
    engine = wm.backend == "deepspeed"
    opt = None if engine else torch.optim.AdamW(wm.module.parameters(), lr=1e-5)
    tokens = torch.arange(64).reshape(2, 32) % 1024
    loss = wm(input_ids=tokens, labels=tokens).loss
    if engine:
        wm.module.backward(loss)
        wm.module.step()
    else:
        assert opt is not None
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = wm.sleep(opt)
    wm.wake()
    below = as_adapter(wm)
    state = [t for _, t in training_state(below, (below.states and below.states.own_optimizer()) or opt)]

    def cycle() -> None:
        wm.sleep(opt)
        wm.wake()

    def by_hand() -> None:
        with torch.no_grad():
            away = [t.to("cpu", copy=True) for t in state]
            for t, a in zip(state, away, strict=True):
                t.copy_(a)

    ways = {"bare": bare, "stream": stream, "stream_load": stream_load, "named": named, "trl": trl,
            "cycle": cycle, "by_hand": by_hand}
    for fn in ways.values():  # warm-up
        barrier_timed(fn)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(reps):
        order = list(ways.items()) if i % 2 else list(reversed(ways.items()))
        for key, fn in order:
            times[key].append(barrier_timed(fn))
    buckets = sum(1 for _ in wm.stream_full_parameters(BUCKET))
    return {"times": {k: median(v) for k, v in times.items()}, "samples": times, "megabytes": total / 2**20,
            "buckets": buckets, "params": sum(1 for _ in wm.unwrap().parameters()),
            "state_mb": report.state_bytes / 2**20}


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 3 if quick else 7
    rows = []
    with two_ranks() as group:
        for backend in ("zero3", "fsdp", "fsdp2", "tp"):
            for size, hidden in SIZES.items():
                if quick and size != "M":
                    continue
                obs = group.run(_times, backend, hidden, reps, timeout=600)[0]
                t, x = obs["times"], obs["samples"]
                what = (f"{obs['megabytes']:.0f} MB in {obs['buckets']} buckets of {BUCKET >> 20} MiB, "
                        f"{obs['params']} parameters, median of {reps}")
                rows.append(row(f"{backend} {size} vs bare all-gather", t["stream"], t["bare"], GOAL_BANDWIDTH,
                                better="higher", samples=(x["stream"], x["bare"]),
                                note=f"bandwidth ratio; {what}"))
                rows.append(row(f"{backend} {size} vs named_full_parameters", t["stream_load"], t["named"], 1.0,
                                better="higher", samples=(x["stream_load"], x["named"]),
                                note="speed-up, loaded into a model"))
                per_tensor = "per-tensor full_tensor()" if backend == "tp" else "TRL per-tensor"
                rows.append(row(f"{backend} {size} vs {per_tensor}", t["stream_load"], t["trl"], 1.0,
                                better="higher", samples=(x["stream_load"], x["trl"]),
                                note="speed-up, loaded into a model"))
                rows.append(row(f"{backend} {size} sleep+wake", t["cycle"], t["by_hand"], GOAL_CYCLE,
                                samples=(x["cycle"], x["by_hand"]),
                                note=f"{obs['state_mb']:.0f} MB of training state per rank, against copying it "
                                     "away and back by hand"))
    return rows


if __name__ == "__main__":
    print_rows("stream_full_parameters vs the floor and the per-tensor ways", run())
