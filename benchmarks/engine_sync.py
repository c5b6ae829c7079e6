"""Sending less to an engine in another process, after one AdamW step at an RL learning rate (1e-6, fp32 weights,
a bf16 wire), FSDP2 on two gloo ranks, timed alternately in one run:

* **delta vs full**: a sparse ``DeltaSync`` round (each rank diffs its share of every streamed tensor against its
  snapshot; the changed positions and values reach rank 0, which applies them to the engine's copy as vLLM's
  sparse receiver does) against a dense sync of the same stream (every bucket loaded into the engine's copy).
  Two rows: the bytes that cross to the engine, and the time. The note gives the fraction of values that changed.
* **dense round vs full**: the bytes of a dense round through the sparse backend (every position with its
  value), against the dense stream: what the first sync costs (goal: the positions' own cost, 3x on bf16).
* **adapter vs merged**: the LoRA adapter alone (saved in PEFT's layout and read back by rank 0: what
  ``sync_adapters`` hands an engine) against a merged sync of the whole model into the engine's copy; bytes and
  time.

No engine runs here: time is the trainer's side (gathers, diffs, packing, the engine's copy on the same host),
not a network's; on a real link the bytes rows bound the transfer.
"""

from __future__ import annotations

import os
import tempfile
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
    opt = torch.optim.AdamW(wm.module.parameters(), lr=1e-6)
    engine = tiny_llama(1, layers=8, hidden=HIDDEN, vocab=1024).to(torch.bfloat16)
    held = {n: t.detach() for n, t in engine.state_dict().items()}

    class Apply:  # the engine's side of vLLM's sparse receive: each patch written by flat position
        def send_weights(self, patches: list[Any]) -> None:
            with torch.no_grad():
                for p in patches:
                    held[p.name].view(-1)[p.indices.long()] = p.values

    delta = DeltaSync(wm, dtype=torch.bfloat16, bucket_bytes=BUCKET, dense_every=None)
    dense = delta.send(Apply())  # the dense first sync
    primed = {k: v.clone() for k, v in delta._snapshot.items()}
    _step(wm, opt)
    reports = []

    def restore() -> None:  # the same step's delta at every rep
        delta._snapshot = {k: v.clone() for k, v in primed.items()}

    def sparse() -> None:
        reports.append(delta.send(Apply()))

    def full() -> None:
        stream = wm.stream_full_parameters(BUCKET, torch.bfloat16, dst_rank=0)
        if rank0:
            load_into(engine, stream)
        else:
            for _ in stream:
                pass

    times = _alternate({"sparse": sparse, "full": full}, reps, untimed=restore)
    full_bytes = sum(b.flat.numel() for b in wm.stream_full_parameters(BUCKET, torch.bfloat16))
    out: dict[str, Any] = {"times": times, "full_bytes": full_bytes, "delta": reports[-1]._asdict(),
                           "dense": dense._asdict()}

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
    t, a, d = obs["times"], obs["adapter_times"], obs["delta"]
    fraction = d["changed"] / d["values"]
    what = f"{d['changed']} of {d['values']} values changed ({100 * fraction:.2f}%) after one AdamW step at 1e-6"
    return [
        row("delta vs full, bytes", d["bytes"], obs["full_bytes"], GOAL_BYTES, unit="B",
            note=f"{what}; positions (int32) and values (bf16), against the bf16 stream"),
        row("delta vs full, time", median(t["sparse"]), median(t["full"]), GOAL_TIME,
            samples=(t["sparse"], t["full"]), note=f"median of {reps}; the trainer's side, FSDP2 on 2 ranks"),
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
