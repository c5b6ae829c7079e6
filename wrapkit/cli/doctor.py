"""``wrapkit doctor``: start real process groups, wrap a tiny model with every installed
backend, run every operation and print a backend x operation table."""

from __future__ import annotations

import json
import time
import traceback
from typing import Any

import torch

from .._imports import is_available, version_of
from ._models import BACKENDS, build, tiny_llama, toy_model
from ._ops import OPS
from ._workers import WorkerError, WorkerGroup

__all__ = ["run_doctor", "doctor_backend"]

_NEEDS = {"zero0": "deepspeed", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}


def _base_model(use_llama: bool) -> torch.nn.Module:
    return tiny_llama() if use_llama else toy_model()


def _inputs(use_llama: bool) -> torch.Tensor:
    return torch.arange(16).reshape(2, 8) % 128 if use_llama else torch.linspace(-1, 1, 32).reshape(2, 16)


def doctor_backend(backend: str, use_llama: bool, device: str = "cpu") -> dict[str, Any]:
    """Run on every rank: wrap, then each operation; returns ``{op: [ok, ms, error]}``."""
    import torch.distributed as dist

    from .._registry import adapt

    if device == "cuda":
        # Each rank computes on its own GPU (the worker set it as current).
        device = f"cuda:{torch.cuda.current_device()}"
    plain = _base_model(use_llama).to(device)
    inputs = _inputs(use_llama).to(device)
    with torch.no_grad():
        out = plain(inputs)
    ctx: dict[str, Any] = {
        "inputs": inputs,
        "expected_output": (out.logits if hasattr(out, "logits") else out).float().cpu(),
        "expected_parameters": sum(p.numel() for p in plain.parameters()),
        "has_config": use_llama,
        "device": device,
    }
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        wm = adapt(build(backend, model=_base_model(use_llama), device=device))
    except Exception as exc:
        results["adapt"] = [False, (time.perf_counter() - t0) * 1e3, _first_line(exc)]
        return results
    results["adapt"] = [True, (time.perf_counter() - t0) * 1e3, ""]
    for name, op in OPS:
        t0 = time.perf_counter()
        try:
            op(wm, ctx)
            results[name] = [True, (time.perf_counter() - t0) * 1e3, ""]
        except Exception as exc:
            results[name] = [False, (time.perf_counter() - t0) * 1e3, _first_line(exc)]
            results.setdefault("_trace", traceback.format_exc())
        if dist.is_initialized():
            dist.barrier()
    return results


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _format_table(rows: dict[str, dict[str, Any]], columns: list[str]) -> str:
    header = ["backend", *columns]
    table: list[list[str]] = []
    for backend, res in rows.items():
        if "_status" in res:
            table.append([backend, res["_status"], *[""] * (len(columns) - 1)])
            continue
        cells = [backend]
        for col in columns:
            cell = res.get(col)
            if cell is None:
                cells.append("-")
            else:
                ok, ms, _ = cell
                cells.append(f"{'ok' if ok else 'FAIL'} {ms:.0f}ms")
        table.append(cells)
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in table]
    return "\n".join(lines)


def run_doctor(backends: list[str] | None = None, world_size: int = 2, json_path: str | None = None) -> int:
    """Run the doctor; return the process exit code (non-zero on any failure)."""
    use_llama = is_available("transformers")
    selected = backends or list(BACKENDS)
    versions = {name: version_of(name) for name in ("torch", "deepspeed", "accelerate", "transformers", "peft")}
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    device = "cuda" if use_nccl else "cpu"
    print("wrapkit doctor: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()))
    print(f"model: {'transformers Llama (tiny, from a config)' if use_llama else 'toy MLP'}; "
          f"{world_size} ranks, {'nccl' if use_nccl else 'gloo'} on {device}")
    columns = ["adapt", *(name for name, _ in OPS)]
    rows: dict[str, dict[str, Any]] = {}
    group = WorkerGroup(world_size=world_size, backend="nccl" if use_nccl else "gloo",
                        preload=tuple(p for p in ("transformers", "peft", "deepspeed") if is_available(p)))
    failed = False
    try:
        for backend in selected:
            need = _NEEDS.get(backend)
            if need and not is_available(need):
                rows[backend] = {"_status": f"not installed ({need})"}
                continue
            print(f"  {backend} ...", flush=True)
            try:
                per_rank = group.run(doctor_backend, backend, use_llama, device, timeout=300)
                res = per_rank[0]
                for other in per_rank[1:]:  # a failure on any rank counts
                    for op, cell in other.items():
                        if op != "_trace" and not cell[0] and res.get(op, [False])[0]:
                            res[op] = cell
            except WorkerError as exc:
                res = {"_status": "FAIL", "_error": str(exc).splitlines()[0:3]}
            rows[backend] = res
            if res.get("_status") == "FAIL" or any(not c[0] for k, c in res.items() if not k.startswith("_")):
                failed = True
    finally:
        group.close()
    print()
    print(_format_table(rows, columns))
    problems = [
        f"{backend}/{op}: {cell[2]}"
        for backend, res in rows.items()
        for op, cell in res.items()
        if not op.startswith("_") and not cell[0]
    ] + [f"{b}: {' | '.join(r['_error'])}" for b, r in rows.items() if r.get("_status") == "FAIL"]
    if problems:
        print("\nfailures:")
        for line in problems:
            print("  " + line)
    print(f"\n{'FAILED' if failed else 'all passed'}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"versions": versions, "world_size": world_size, "results": rows}, fh, indent=2, default=str)
    return 1 if failed else 0
