"""On one CUDA GPU: bf16 generation, the Hub-layout stream and sleep/wake, each beside its baseline.

A transformers Llama in bf16 built on the GPU from a config (``--layers`` layers of hidden 2048,
intermediate 5504, vocab 32000: about 0.94 B parameters at 16 layers), one NCCL rank. Each backend
(DDP, FSDP1, FSDP2, and ZeRO-3 where DeepSpeed is installed) wraps its own copy of the same weights.

- generation: greedy ``generate()`` of 64 new tokens for a batch of 4, best of ``--reps``, inside
  ``wm.generation()`` (its entry included) against the same weights unsharded, and against the naive way
  (the wrapped model's own forward: FSDP's hooks gather each unit for every token);
- stream: ``stream_full_parameters`` in bf16 (512 MiB buckets), GB/s of weights delivered, against a plain
  ``torch.cat`` of the unsharded weights into one buffer (the device's own copy speed);
- sleep/wake: after one AdamW step, ``wm.sleep(optimizer)`` then ``wm.wake()``: the bytes it reports freed
  against what ``torch.cuda.memory_allocated`` shows left the device (what stayed is listed where they
  differ), the seconds each took against copying the same tensors away and back by hand (into pageable
  memory, and into pinned memory), the weights compared bit for bit after the wake, and a step after it.

Run: ``python benchmarks/gpu.py`` (one process; it starts its own one-rank group), or ``wrapkit bench gpu``;
``--cpu-check`` runs a tiny model on the CPU, to check the script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NEW_TOKENS = 64
BATCH, PROMPT = 4, 32
DEV = "cuda"  # --cpu-check: a tiny model on the CPU, to check the script itself before a GPU is lent
HIDDEN, INTERMEDIATE = 2048, 5504


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


def llama(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model: Any = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).train()


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (BATCH, PROMPT), generator=g).to(DEV)
    return ids, torch.ones_like(ids)


def generate(m: Any) -> torch.Tensor:
    ids, mask = prompt()
    with torch.no_grad():
        out: torch.Tensor = m.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                       min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out


def best(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times), out


def wrap(spec: str, model: Any) -> tuple[torch.nn.Module, Any]:
    """(the wrapped model, its optimizer) for ``spec``, built as a trainer would."""
    import torch.distributed as dist

    if spec == "ddp":
        m: Any = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if DEV == "cuda" else None)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)
    if spec == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        device = torch.device(DEV, 0) if DEV == "cuda" else torch.device("cpu")
        m = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=device, use_orig_params=True)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)
    if spec == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if spec == "zero3":
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
               "steps_per_print": 10**9}
        engine, opt, _, _ = deepspeed.initialize(model=model, config=cfg, dist_init_required=not dist.is_initialized())
        return engine, opt
    raise ValueError(spec)


def step(m: Any, opt: Any, engine: bool) -> float:
    ids, mask = prompt()
    loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
    if engine:
        m.backward(loss)
        m.step()
    else:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return float(loss)


@contextlib.contextmanager
def section(results: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    out: dict[str, Any] = {}
    results[name] = out
    try:
        yield out
    except Exception as e:  # one backend's failure is reported, the others still measured
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  {name}: FAILED {out['error']}", flush=True)


def one_backend(spec: str, state: dict[str, torch.Tensor], layers: int, reps: int, base: dict[str, Any],
                out: dict[str, Any]) -> None:
    """Generation, stream and sleep/wake of one backend's copy of the weights, into ``out``."""
    import wrapkit

    model = llama(layers)
    model.load_state_dict(state)
    m, opt = wrap(spec, model)
    engine = spec.startswith("zero")
    wm = wrapkit.adapt(m)
    step(m, opt, engine)  # the state a loop leaves: one step taken, optimizer state on the device

    def wrapkit_way() -> torch.Tensor:
        with wm.generation() as g:
            return generate(g)

    wrapkit_way()
    t_wk, got = best(wrapkit_way, reps)
    out.update(generation_s=t_wk, generation_ratio=t_wk / base["unsharded_s"])
    line = f"  generation {t_wk:.3f} s = {out['generation_ratio']:.2f}x unsharded"
    if spec in ("fsdp2", "ddp"):
        # The naive way: the wrapped model's own forward, its hooks (FSDP2) or wrapper (DDP) left on.
        inner: Any = m.module if spec == "ddp" else m
        inner.eval()
        t_naive, naive_tokens = best(lambda: generate(inner), max(1, reps - 1))
        inner.train()
        out.update(naive_s=t_naive, naive_ratio=t_naive / base["unsharded_s"],
                   same_tokens_as_naive=bool(torch.equal(naive_tokens, got)))
        line += f"; naive {t_naive:.3f} s = {out['naive_ratio']:.2f}x (same tokens: {out['same_tokens_as_naive']})"
    print(line, flush=True)

    def stream() -> int:
        return sum(bucket.flat.numel() for bucket in wm.stream_full_parameters(dtype=torch.bfloat16))

    stream()
    t_stream, n = best(stream, reps)
    out.update(stream_gbps=n / t_stream / 1e9, stream_vs_cat=n / t_stream / 1e9 / base["cat_gbps"])
    print(f"  stream {n / 1e9:.2f} GB in {t_stream:.3f} s = {out['stream_gbps']:.1f} GB/s "
          f"({out['stream_vs_cat']:.2f}x a plain torch.cat at {base['cat_gbps']:.0f} GB/s)", flush=True)

    before = None if engine else {k: v.detach().float().clone() for k, v in wm.named_full_parameters()}
    if DEV == "cuda":
        out.update(by_hand(wm, None if engine else opt))
        print(f"  by hand, the same tensors: to pageable CPU memory and back {out['hand_away_s']:.3f} + "
              f"{out['hand_back_s']:.3f} s; to pinned memory and back {out['pinned_away_s']:.3f} + "
              f"{out['pinned_back_s']:.3f} s", flush=True)
    sync()
    alloc0 = allocated()
    t0 = time.perf_counter()
    report = wm.sleep(None if engine else opt)
    sync()
    t_sleep, alloc1 = time.perf_counter() - t0, allocated()
    t0 = time.perf_counter()
    wm.wake()
    sync()
    t_wake, alloc2 = time.perf_counter() - t0, allocated()
    if "hand_away_s" in out:
        out.update(sleep_vs_hand=t_sleep / out["hand_away_s"], wake_vs_hand=t_wake / out["hand_back_s"])
    out.update(sleep_s=t_sleep, wake_s=t_wake, reported_freed=report.freed_bytes, state_bytes=report.state_bytes,
               allocated_drop=alloc0 - alloc1, allocated_back=alloc2 - alloc1)
    print(f"  sleep {t_sleep:.3f} s: {report}; torch.cuda.memory_allocated fell by {(alloc0 - alloc1) / 2**30:.2f} "
          f"GiB; wake {t_wake:.3f} s, back {(alloc2 - alloc1) / 2**30:.2f} GiB", flush=True)
    if DEV == "cuda" and alloc0 - alloc1 < 0.95 * report.freed_bytes:
        out["left_on_device"] = left_on_device()
        print(f"  still on the device while asleep: {out['left_on_device']}", flush=True)
    if before is not None:
        after = dict(wm.named_full_parameters())
        out["weights_equal_after_wake"] = all(torch.equal(before[k], after[k].float()) for k in before)
        print(f"  weights bit for bit after wake: {out['weights_equal_after_wake']}", flush=True)
    out["step_after_wake_loss"] = step(m, opt, engine)


def by_hand(wm: Any, opt: Any) -> dict[str, float]:
    """Seconds to copy the tensors ``sleep()`` moves (this rank's parameters, gradients and optimizer
    state) to the CPU and back by hand: one ``.to()`` each into pageable memory, then into pinned memory
    with non-blocking copies. The copies are dropped; the model is untouched."""
    from wrapkit.sync.sleeping import _states, training_state

    adapter = wm._below
    tensors = [t for _, t in training_state(adapter, _states(adapter).own_optimizer() or opt) if t.is_cuda]
    out: dict[str, float] = {}
    for kind, pin in (("hand", False), ("pinned", True)):
        sync()
        t0 = time.perf_counter()
        if pin:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        else:
            host = [t.to("cpu") for t in tensors]
        sync()
        out[f"{kind}_away_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = [h.to("cuda", non_blocking=pin) for h in host]
        sync()
        out[f"{kind}_back_s"] = time.perf_counter() - t0
        del host, back
    return out


def left_on_device(limit: int = 8) -> list[str]:
    """The largest CUDA tensors the garbage collector can see, with the types of what refers to them."""
    import gc

    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    found.sort(key=lambda t: -t.untyped_storage().nbytes())
    out = []
    for t in found[:limit]:
        refs: set[str] = set()
        for r in gc.get_referrers(t):
            if isinstance(r, dict):
                refs.update(f"dict[{k!r}]" for k, v in r.items() if v is t)
            elif r is not found:
                refs.add(type(r).__name__)
        mib = t.untyped_storage().nbytes() / 2**20
        out.append(f"{type(t).__name__}{tuple(t.shape)} {t.dtype} storage {mib:.0f} MiB <- {','.join(sorted(refs))}")
    return out


def measure(layers: int, reps: int, specs: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
                               "torch": torch.__version__, "layers": layers}
    plain = llama(layers).eval()
    results["params_b"] = sum(p.numel() for p in plain.parameters()) / 1e9
    generate(plain)  # warm-up: kernels, caches
    results["unsharded_s"], _ = best(lambda: generate(plain), reps)
    print(f"unsharded bf16 generate: {results['unsharded_s']:.3f} s ({BATCH}x{NEW_TOKENS} tokens)", flush=True)
    flat = [p.detach() for p in plain.parameters()]
    t_cat, _ = best(lambda: torch.cat([p.reshape(-1) for p in flat]), reps)
    results["cat_gbps"] = sum(p.numel() * p.element_size() for p in flat) / t_cat / 1e9
    state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    flat.clear()
    plain.to("meta")
    for spec in specs:
        print(f"== {spec}", flush=True)
        with section(results, spec) as out:
            one_backend(spec, state, layers, reps, results, out)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return results


def run(quick: bool = False) -> list[dict[str, Any]]:
    """For ``wrapkit bench``: rows for generation, the stream and sleep/wake per backend; none without a GPU."""
    from _common import row

    if not torch.cuda.is_available():
        print("   needs a CUDA GPU: nothing measured")
        return []
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        specs = ["ddp", "fsdp", "fsdp2"] + ([] if _lacks_deepspeed() else ["zero3"])
        results = measure(4 if quick else 16, 2 if quick else 3, specs)
    finally:
        if started:
            dist.destroy_process_group()
    rows = []
    for spec in specs:
        r = results[spec]
        if "error" in r:
            raise RuntimeError(f"{spec}: {r['error']}")
        rows.append(row(f"{spec} generation", r["generation_s"], results["unsharded_s"], 1.05,
                        note="wm.generation() vs the unsharded model"))
        rows.append(row(f"{spec} stream", r["stream_gbps"], results["cat_gbps"], 0.5, better="higher", unit="GB/s",
                        note="stream_full_parameters vs torch.cat of the same weights"))
        rows.append(row(f"{spec} sleep", r["sleep_s"], r["hand_away_s"], 1.5,
                        note=f"freed {r['allocated_drop'] / 2**30:.2f} GiB of {r['state_bytes'] / 2**30:.2f} GiB"))
    return rows


def _lacks_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--specs", default="ddp,fsdp,fsdp2,zero3")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--cpu-check", action="store_true", help="a tiny model on the CPU: checks the script")
    args = parser.parse_args(argv)
    global DEV, HIDDEN, INTERMEDIATE
    if args.cpu_check:
        DEV, HIDDEN, INTERMEDIATE = "cpu", 64, 128
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    specs = args.specs.split(",")
    if _lacks_deepspeed():
        specs = [s for s in specs if not s.startswith("zero")]
        print("DeepSpeed is not installed: ZeRO-3 left out")
    try:
        results = measure(args.layers, args.reps, specs)
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
