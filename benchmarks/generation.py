"""Greedy generation speed under ZeRO-3, FSDP1, FSDP2 and tensor parallelism, against the physical floor.

A sharded model must be gathered once per ``generate()`` call, so the floor is the same
model's unsharded ``generate()`` plus one bare ``all_gather_into_tensor`` of its weight bytes
(in the dtype the backend gathers in). Two gloo ranks on the CPU; a transformers Llama built
from a config (8 layers, hidden 256, intermediate 512, vocab 1024); batch 2, prompt 16, 64 new
tokens. Every way is timed in the same run, alternating with the floor's two parts, on the same
weights, and must produce the unsharded tokens. Each time is the best of ``--reps`` runs, the
entry into the context (the gather) included. FSDP1 runs a second time once the ZeRO-3 engine
exists (DeepSpeed then replaces ``F.linear`` for the whole process). Tensor parallelism gathers only
the layers its plan split, so the whole model's bytes overstate its floor's gather; its naive way is
the TP forward as it is (``gather="layerwise"``), two collectives per layer per token.
Run: ``python benchmarks/generation.py [--reps N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "generation"
GOAL = 1.05  # of the floor
NEW_TOKENS = 64
BESIDE = "fsdp beside zero3"  # FSDP1 in a process that also holds a ZeRO-3 engine


def llama(seed: int = 0, vocab: int = 1024) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 1024, (2, 16), generator=g)


def generate(m: Any) -> torch.Tensor:
    out: torch.Tensor = m.generate(
        prompt(), attention_mask=torch.ones(2, 16, dtype=torch.long), max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
    )
    return out


def timed(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    import torch.distributed as dist

    best, tokens = float("inf"), torch.empty(0)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        tokens = fn()
        best = min(best, time.perf_counter() - t0)
    return best, tokens


@contextlib.contextmanager
def trl_style(engine: Any) -> Iterator[torch.nn.Module]:
    """ZeRO-3 generation as TRL's ``unwrap_model_for_generation`` does it: gather, drop the hooks, re-add them."""
    import deepspeed

    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        for p in engine.module.parameters():
            p.ds_active_sub_modules.clear()
        for h in offload.forward_hooks + offload.backward_hooks:
            h.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield engine.module
        finally:
            offload._register_deepspeed_module(offload.module)


def bare_gather(wm: Any) -> Callable[[], torch.Tensor]:
    """One ``all_gather_into_tensor`` of the model's full weight bytes in the dtype it gathers in:
    the least any sharded generation must communicate."""
    from wrapkit._gather import all_gather_into

    adapter = wm._below  # the backend's own sizes and group
    world = max(wm.world_size, 1)
    dtype = next((p.dtype for p in wm.unwrap().parameters() if p.is_floating_point()), torch.float32)
    numel = -(-adapter.gatherer.full_bytes() // (dtype.itemsize * world))  # the bytes the backend gathers
    send = torch.ones(numel, dtype=dtype)
    recv = torch.empty(numel * world, dtype=dtype)

    def gather() -> torch.Tensor:
        all_gather_into(recv, send, group=adapter.process_group())
        return recv
    return gather


BACKENDS = ("fsdp", "fsdp2", "tp", "zero3")


def bench(reps: int, backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """Runs on every rank; returns {way: (seconds, unsharded seconds, gather seconds, same tokens
    as unsharded, (every time of the way, every floor timed beside it))}; the floor is unsharded + gather.

    ZeRO-3 goes last: its engine replaces F.linear for the rest of the process, which
    would slow the FSDP runs in a way no FSDP job ever sees. FSDP1 then runs again, beside it.
    """
    import wrapkit
    from wrapkit.cli._models import build

    results: dict[str, Any] = {}
    plain = llama().eval()
    # Once a ZeRO-3 engine exists DeepSpeed has replaced F.linear process-wide; the
    # unsharded model is timed with torch's own, as it runs in a process without ZeRO-3.
    torch_linear = torch.nn.functional.linear

    def unsharded() -> torch.Tensor:
        patched = torch.nn.functional.linear
        torch.nn.functional.linear = torch_linear
        try:
            return generate(plain)
        finally:
            torch.nn.functional.linear = patched

    base_time, want = timed(unsharded, reps)
    results["unsharded"] = (base_time, base_time, 0.0, True, ([base_time], [base_time]))

    def record(way: str, fn: Callable[[], torch.Tensor], gather: Callable[[], torch.Tensor]) -> None:
        # The floor's parts are timed right next to each way: the ratio does not
        # drift with whatever else the machine is doing meanwhile.
        best, base, comm, same = float("inf"), float("inf"), float("inf"), True
        ways: list[float] = []
        floors: list[float] = []
        for _ in range(reps):
            b, _ = timed(unsharded, 1)
            c, _ = timed(gather, 1)
            secs, got = timed(fn, 1)
            best, base, comm = min(best, secs), min(base, b), min(comm, c)
            ways.append(secs)
            floors.append(b + c)
            same = same and bool(torch.equal(got, want))
        results[way] = (best, base, comm, same, (ways, floors))

    from wrapkit._imports import is_available

    def wrapkit_way(wm: Any) -> Callable[[], torch.Tensor]:
        def way() -> torch.Tensor:
            with wm.generation() as m:
                return generate(m)
        return way

    fsdp_wm = None
    for backend in backends:
        if backend == "zero3" and not is_available("deepspeed"):
            continue
        model = build(backend, model=llama())
        wm = wrapkit.adapt(model)
        gather = bare_gather(wm)
        if backend == "fsdp":
            fsdp_wm = wm
        record(f"{backend}: wm.generation()", wrapkit_way(wm), gather)
        if backend == "zero3":
            def naive_zero3(engine: Any = model) -> torch.Tensor:
                engine.module.eval()
                try:
                    return generate(engine.module)
                finally:
                    engine.module.train()

            def trl(engine: Any = model) -> torch.Tensor:
                with trl_style(engine) as m:
                    m.eval()
                    try:
                        return generate(m)
                    finally:
                        m.train()

            record("zero3: naive (engine.module as is)", naive_zero3, gather)
            record("zero3: TRL-style hook removal", trl, gather)
            if fsdp_wm is not None:
                record(f"{BESIDE}: wm.generation()", wrapkit_way(fsdp_wm), bare_gather(fsdp_wm))
        elif backend == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel

            def naive_fsdp(root: Any = model) -> torch.Tensor:
                root.eval()
                try:
                    with FullyShardedDataParallel.summon_full_params(root, recurse=False):
                        return generate(root.module)
                finally:
                    root.train()

            record("fsdp: naive (root summon, recurse=False)", naive_fsdp, gather)
        elif backend == "tp":
            def layerwise(wm: Any = wm) -> torch.Tensor:
                with wm.generation(gather="layerwise") as m:
                    return generate(m)

            record("tp: naive (TP forward as is)", layerwise, gather)
        else:
            def naive_fsdp2(m: Any = model) -> torch.Tensor:
                m.eval()
                try:
                    m.unshard()
                    return generate(m)
                finally:
                    m.reshard()
                    m.train()

            record("fsdp2: naive (unshard())", naive_fsdp2, gather)
    return results


def measure(reps: int, backends: tuple[str, ...] = BACKENDS) -> list[dict[str, Any]]:
    """All ways on two gloo ranks; rank 0's times, token equality checked on every rank."""
    from _common import two_ranks

    with two_ranks(("transformers", "deepspeed")) as group:
        per_rank = group.run("benchmarks.generation:bench", reps, backends, timeout=900)
    return [
        {"way": way, "seconds": secs, "unsharded": base, "gather": comm, "floor": base + comm,
         "same": all(r[way][3] for r in per_rank), "samples": samples}
        for way, (secs, base, comm, _, samples) in per_rank[0].items()
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """For ``wrapkit bench``: one row per sharded backend, wm.generation() against the floor."""
    from _common import row

    results = measure(1 if quick else 3)
    naive = {r["way"].split(":")[0]: r["seconds"] / r["floor"] for r in results if "naive" in r["way"]}
    rows = []
    for r in results:
        if r["way"].endswith("wm.generation()"):
            backend = r["way"].split(":")[0]
            note = (f"{r['seconds'] / r['unsharded']:.2f}x unsharded; floor = unsharded {r['unsharded']:.3f} s + "
                    f"gather {r['gather']:.3f} s")
            if backend in naive:
                note += f"; naive {naive[backend]:.2f}x floor"
            note += "" if r["same"] else "; TOKENS DIFFER"
            rows.append({**row(backend, r["seconds"], r["floor"], GOAL, note=note, samples=r["samples"]),
                         "baseline_is_floor": True})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset")
    args = parser.parse_args(argv)
    results = measure(args.reps, tuple(b.strip() for b in args.backends.split(",") if b.strip()))
    print(f"greedy generation, batch 2, prompt 16, {NEW_TOKENS} new tokens, 2 gloo ranks, best of {args.reps};")
    print("floor: unsharded generate() + one bare all-gather of the weight bytes, timed alternately with each "
          f"way (rank 0); goal for wm.generation(): <= {GOAL}x the floor")
    print(f"{'way':45s} {'seconds':>8s} {'unsharded':>9s} {'gather':>7s} {'floor':>6s} {'of floor':>8s} "
          f"{'of unsh.':>8s}  tokens")
    for r in results:
        print(f"{r['way']:45s} {r['seconds']:8.3f} {r['unsharded']:9.3f} {r['gather']:7.3f} {r['floor']:6.3f} "
              f"{r['seconds'] / r['floor']:7.2f}x {r['seconds'] / r['unsharded']:7.2f}x  "
              f"{'same' if r['same'] else 'DIFFERENT'}")
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
