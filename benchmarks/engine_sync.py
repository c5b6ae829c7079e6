"""Sending less to an engine in another process, a bf16 wire, two gloo ranks, timed alternately in one run:

* **shard delta vs full**: a sparse ``DeltaSync`` round diffed where the weights live (each rank compares its own
  shard with its snapshot; only the changed positions and values reach rank 0, which applies them to the
  engine's copy as vLLM's sparse receiver does), against a full sync (``stream_full_parameters`` into the engine's
  copy), on FSDP2 and ZeRO-3 at 0.1%, 4% and 50% of values changed: time, and on FSDP2 the bytes rank 0 received
  through the trainer's collectives. Beside it the **gathered delta**, the way before (the full weights gathered
  first, then diffed), against the same full sync.
* **dense round vs full**: the bytes of a dense round through the sparse backend (every position with its
  value), against the dense stream: what the first sync costs (goal: the positions' own cost, 3x on bf16).
* **adapter vs merged**: the LoRA adapter alone (saved in PEFT's layout and read back by rank 0: what
  ``sync_adapters`` hands an engine) against a merged sync of the whole model into the engine's copy; bytes and
  time.

No engine runs here: time is the trainer's side (gathers, diffs, packing, the engine's copy on the same host),
not a network's; on a real link the bytes rows bound the transfer.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

import torch
from _common import barrier_timed, median, print_rows, row, two_ranks

NAME = "engine_sync"
GOAL_BYTES = 0.25  # a step at an RL rate changes few bf16 values: a delta is a small part of a full sync
GOAL_TIME = 1.25  # the delta's diff and second gather cost little beside the stream they ride on
GOAL_ADAPTER = 0.1
HIDDEN = 512  # an 8-layer Llama (vocab 1024): 75 MB in fp32
BUCKET = 16 * 2**20


def _step(wm: Any, opt: torch.optim.Optimizer) -> None:
    tokens = torch.arange(64).reshape(2, 32) % 1024
    wm(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _times(reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import wrapkit
    from wrapkit.cli._models import build, tiny_llama
    from wrapkit.integrations.vllm import DeltaSync, load_into

    rank0 = dist.get_rank() == 0
    wm = wrapkit.adapt(build("fsdp2", model=tiny_llama(0, layers=8, hidden=HIDDEN, vocab=1024)))
    engine = tiny_llama(1, layers=8, hidden=HIDDEN, vocab=1024).to(torch.bfloat16)
    held = {n: t.detach() for n, t in engine.state_dict().items()}

    class Apply:  # the engine's side of vLLM's sparse receive: each patch written by flat position (index_copy_)
        writes: list[float] = []  # seconds each round spent writing into the engine's copy

        def send_weights(self, patches: list[Any]) -> None:
            t0 = time.perf_counter()
            with torch.no_grad():
                for p in patches:
                    held[p.name].view(-1).index_copy_(0, p.indices.long(), p.values)
            Apply.writes.append(time.perf_counter() - t0)

    delta = DeltaSync(wm, dtype=torch.bfloat16, bucket_bytes=BUCKET, dense_every=None)
    dense = delta.send(Apply())  # the dense first sync
    out: dict[str, Any] = {"dense": dense._asdict(),
                           "full_bytes": sum(b.flat.numel() for b in wm.stream_full_parameters(BUCKET, torch.bfloat16))}
    out["rounds"] = {spec: _rounds(spec, reps, engine, held, Apply) for spec in ("fsdp2", "zero3")}
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(0, layers=8, hidden=HIDDEN, vocab=1024),
                           LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    pm = wrapkit.adapt(build("fsdp2", model=model))
    root = tempfile.mkdtemp() if rank0 else ""
    box = [root]
    dist.broadcast_object_list(box, src=0)
    adapter_bytes = [0]
    count = [0]

    def adapter() -> None:
        count[0] += 1
        path = os.path.join(box[0], f"v{count[0]}")
        pm.save_pretrained(path, adapters_only=True)
        if rank0:
            from safetensors.torch import load_file

            tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
            adapter_bytes[0] = sum(t.numel() * t.element_size() for t in tensors.values())

    def merged() -> None:
        stream = pm.stream_full_parameters(BUCKET, torch.bfloat16, merge_adapters=True, dst_rank=0)
        if rank0:
            load_into(engine, stream)
        else:
            for _ in stream:
                pass

    out["adapter_times"] = _alternate({"adapter": adapter, "merged": merged}, reps, untimed=lambda: None)
    out["adapter_bytes"] = adapter_bytes[0]
    out["merged_bytes"] = sum(b.flat.numel() for b in pm.stream_full_parameters(BUCKET, torch.bfloat16,
                                                                               merge_adapters=True))
    return out


def _rounds(spec: str, reps: int, engine: torch.nn.Module, held: dict[str, torch.Tensor], apply: Any) -> Any:
    """On ``spec``: a sparse round diffed on the ranks' shards, one gathered first (the way before), and a full
    sync into the engine's copy, timed alternately at each fraction of values changed (a fraction of every
    rank's part of every parameter scaled by 1 + 2**-5, which changes its bf16 value); with the bytes each moved
    through the trainer's collectives (counted on FSDP2, whose gathers go through torch.distributed's calls)."""
    import torch.distributed as dist

    import wrapkit
    from wrapkit._registry import as_adapter
    from wrapkit.cli._models import build, tiny_llama
    from wrapkit.integrations.vllm import DeltaSync, load_into

    wm = wrapkit.adapt(build(spec, model=tiny_llama(0, layers=8, hidden=HIDDEN, vocab=1024)))
    views = [p.values(p.source) for p in as_adapter(wm).weights.pieces() if p.values is not None]
    original = [v.clone() for v in views]
    shards = DeltaSync(wm, dtype=torch.bfloat16, bucket_bytes=BUCKET, dense_every=None)
    gathered = DeltaSync(wm, dtype=torch.bfloat16, bucket_bytes=BUCKET, dense_every=None)
    gathered._gather_always = True
    for d in (shards, gathered):
        d.send(apply())
    assert shards._shards is not None
    primed = ([t.clone() for t in shards._shards._snapshot], {k: v.clone() for k, v in gathered._snapshot.items()})

    def restore() -> None:  # the same changes' delta at every rep
        assert shards._shards is not None
        shards._shards._snapshot = [t.clone() for t in primed[0]]
        gathered._snapshot = {k: v.clone() for k, v in primed[1].items()}

    reports: dict[str, Any] = {}
    writes: list[float] = []  # seconds each full sync spent writing into the engine's copy
    shard_writes: list[float] = []  # and each shard round

    def full() -> None:
        spent = 0.0
        for bucket in wm.stream_full_parameters(BUCKET, torch.bfloat16, dst_rank=0):
            if dist.get_rank() == 0:
                t0 = time.perf_counter()
                load_into(engine, [bucket])
                spent += time.perf_counter() - t0
        writes.append(spent)

    out = {}
    for fraction in (0.001, 0.04, 0.5):
        gen = torch.Generator().manual_seed(dist.get_rank())
        with torch.no_grad():
            for view, was in zip(views, original, strict=True):
                view.copy_(was)
                view.mul_(torch.where(torch.rand(view.shape, generator=gen) < fraction, 1 + 2**-5, 1.0))
        shard_writes.clear()

        def shard_round() -> None:
            before = len(apply.writes)
            reports["shards"] = shards.send(apply())
            shard_writes.append(sum(apply.writes[before:]))

        ways = {"shards": shard_round,
                "gathered": lambda: reports.__setitem__("gathered", gathered.send(apply())), "full": full}
        writes.clear()
        times = _alternate(ways, reps, untimed=restore)
        # The same rounds less rank 0's writes into the engine's copy (the warm-up's come first).
        trainer = {"shards": [t - w for t, w in zip(times["shards"], shard_writes[-reps:], strict=True)],
                   "full": [t - w for t, w in zip(times["full"], writes[-reps:], strict=True)]}
        moved = {}
        for key, fn in ways.items():
            restore()
            with _counted() as box:
                fn()
            moved[key] = box[0]
        # A full sync brings every tensor whole to rank 0: at least the other ranks' shards, in the stored dtype
        # (FSDP2's and DeepSpeed's own gathers do not pass through the calls counted above).
        moved["full"] = sum(p.numel() * p.element_size() for p in as_adapter(wm).module.parameters()
                            if p.numel()) if spec == "zero3" else sum(
            v.numel() * v.element_size() for v in views) * (dist.get_world_size() - 1)
        out[fraction] = {"times": times, "trainer": trainer, "moved": moved, "report": reports["shards"]._asdict(),
                         "gathered_report": reports["gathered"]._asdict()}
    return out


@contextlib.contextmanager
def _counted() -> Any:
    """Bytes this rank received through torch.distributed's gathers and broadcasts while inside."""
    import torch.distributed as dist

    box = [0]
    names = ("all_gather_into_tensor", "all_gather", "gather", "broadcast")
    saved = {n: getattr(dist, n) for n in names}

    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(size(t) for t in x) if isinstance(x, (list, tuple)) else 0

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            box[0] += size(args[0]) if args else 0
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, counting(n))
    try:
        yield box
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _alternate(ways: dict[str, Any], reps: int, untimed: Any) -> dict[str, list[float]]:
    """``reps`` timings of each way, in alternating order, ``untimed()`` before each."""
    for fn in ways.values():  # warm-up
        untimed()
        barrier_timed(fn)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(reps):
        for key, fn in (list(ways.items()) if i % 2 else list(reversed(ways.items()))):
            untimed()
            times[key].append(barrier_timed(fn))
    return times


def run(quick: bool = False) -> list[dict[str, Any]]:
    reps = 3 if quick else 7
    with two_ranks() as group:
        obs = group.run(_times, reps, timeout=600)[0]
    a = obs["adapter_times"]
    rows = []
    for spec, rounds in obs["rounds"].items():
        for fraction, r in rounds.items():
            t, m, d = r["times"], r["moved"], r["report"]
            what = f"{spec}, {100 * d['changed'] / d['values']:.1f}% of values changed"
            goal = 0.5 if fraction == 0.04 else 1.0
            rows.append(row(f"shard delta vs full, time ({spec}, {100 * fraction:g}%)", median(t["shards"]),
                            median(t["full"]), goal, samples=(t["shards"], t["full"]),
                            note=f"{what}; median of {reps}; diffed on each rank's shards, the trainer's side"))
            w = r["trainer"]
            rows.append(row(f"shard delta vs full, time less the engine's writes ({spec}, {100 * fraction:g}%)",
                            median(w["shards"]), median(w["full"]), goal, samples=(w["shards"], w["full"]),
                            note="the same rounds less rank 0's writes into the engine's copy (by position for "
                                 "the patches, whole tensors for the full sync)"))
            rows.append(row(f"gathered delta vs full, time ({spec}, {100 * fraction:g}%)", median(t["gathered"]),
                            median(t["full"]), GOAL_TIME, samples=(t["gathered"], t["full"]),
                            note="the full weights gathered first, then diffed (the way before)"))
            if spec == "fsdp2":
                rows.append(row(f"shard delta vs full, collective bytes ({100 * fraction:g}%)", m["shards"],
                                m["full"], 0.2 if fraction == 0.04 else 1.0, unit="B",
                                note="received by rank 0 through the trainer's collectives, against the other "
                                     "rank's shards in fp32 (what a full sync must bring to rank 0)"))
            if fraction == 0.04:
                rows.append(row(f"shard delta vs full, engine bytes ({spec})", d["bytes"], obs["full_bytes"],
                                GOAL_BYTES, unit="B",
                                note="positions (int32) and values (bf16) to the engine, against the bf16 stream"))
    return rows + [
        row("dense round vs full, bytes", obs["dense"]["bytes"], obs["full_bytes"], 3.0, unit="B",
            note="the first (and every dense_every-th) sync through the sparse backend: every position, int32, "
                 "beside every bf16 value"),
        row("adapter vs merged, bytes", obs["adapter_bytes"], obs["merged_bytes"], GOAL_ADAPTER, unit="B",
            note="LoRA r=16 on q/k/v/o in fp32, against the merged model on a bf16 wire"),
        row("adapter vs merged, time", median(a["adapter"]), median(a["merged"]), 1.0,
            samples=(a["adapter"], a["merged"]), note=f"median of {reps}; saved and read back, against streamed "
                                                       "merged into the engine's copy"),
    ]


if __name__ == "__main__":
    print_rows("sending less to an engine: deltas and adapters", run())
