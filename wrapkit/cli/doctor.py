"""``wrapkit doctor``: start real process groups, wrap a tiny model with every installed
backend, run every operation and print a backend x operation table."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._imports import is_available, version_of
from ._families import FAMILIES, RECIPE_FAMILIES, any_model, model_inputs
from ._models import build, needs, recipes, supports
from ._ops import OPS, Refused
from ._workers import WorkerError, WorkerGroup, keep_groups, release_kept_groups

__all__ = ["run_doctor", "setup_backend", "run_op", "teardown_backend", "cause_of"]

_OP_TIMEOUT = 120.0

# Per-worker state between calls: backend -> (wm, ctx). Lives in the worker processes.
_STATE: dict[str, tuple[Any, dict[str, Any]]] = {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# How far a result computed in bf16 may be from the fp32 model's: logits, and weights rounded to bf16.
_TOLERANCES = {"fp32": (1e-3, 0.0), "bf16": (0.1, 1e-3)}


_WIDTH = 100  # the report fits a terminal this wide


def _cell(ok: bool, t0: float, exc: BaseException | None = None) -> dict[str, Any]:
    """One result: whether it passed, its milliseconds, and the error's first line and traceback."""
    return {"ok": ok, "ms": (time.perf_counter() - t0) * 1e3, "error": _first_line(exc) if exc else "",
            "traceback": traceback.format_exc() if exc else ""}


def deepspeed_setup() -> dict[str, Any]:
    """Worker side: what DeepSpeed's first use costs once per process, measured apart so that the
    first DeepSpeed backend's adapt row does not carry it: its communication setup, which builds a
    CPU op with the C++ compiler the first time it runs on a machine (tens of seconds), then loads it."""
    import deepspeed

    t0 = time.perf_counter()
    try:
        deepspeed.init_distributed()
    except Exception as exc:
        return {**_cell(False, t0, exc), "what": "DeepSpeed communication setup"}
    return {**_cell(True, t0), "what": "DeepSpeed communication setup (builds its CPU op on first use)"}


def setup_backend(backend: str, model: str, device: str = "cpu", dtype: str = "fp32",
                  topology: str = "flat") -> dict[str, Any]:
    """Worker side: wrap the model with ``backend``; the adapt row's cell."""
    from .._adapt import adapt
    from .._registry import as_adapter

    if device == "cuda":
        # Each rank computes on its own GPU (the worker made it current).
        device = f"cuda:{torch.cuda.current_device()}"
    plain = any_model(model).to(device)
    inputs, extra = model_inputs(model)
    inputs, extra = inputs.to(device), {k: v.to(device) for k, v in extra.items()}
    with torch.no_grad():
        out = plain(inputs, **extra)
    ctx: dict[str, Any] = {
        "backend": backend,
        "model": model,
        "inputs": inputs,
        "extra_inputs": extra,
        "expected_output": (out.logits if hasattr(out, "logits") else out).float().cpu(),
        "expected_parameters": sum(p.numel() for p in plain.parameters()),
        "has_config": model != "toy",
        "device": device,
        "precision": dtype,
        "topology": topology,
        "output_tol": _TOLERANCES[dtype][0],
        "weight_tol": _TOLERANCES[dtype][1],
    }
    # Megatron-Core's forward runs on CUDA only (it moves its rotary tables to the current CUDA device).
    ctx["no_forward"] = ("Megatron-Core's forward needs CUDA (its rotary embedding moves to torch.cuda"
                         ".current_device())") if backend == "megatron" and not device.startswith("cuda") else ""
    t0 = time.perf_counter()
    try:
        wm = adapt(build(backend, model=any_model(model), device=device, precision=dtype, topology=topology))
        # A backend with a layout of its own (Megatron-Core's names and fused tensors) is compared in it.
        ctx["layout"] = as_adapter(wm).hub_layout()
        ctx["names"] = list(as_adapter(wm).weights.param_shapes())  # the whole model's, in its runtime layout
    except Exception as exc:
        return _cell(False, t0, exc)
    _STATE[backend] = (wm, ctx)
    keep_groups()  # the model lives on through the operations' calls
    _barrier()
    return _cell(True, t0)


def run_op(backend: str, name: str) -> dict[str, Any]:
    """Worker side: run one operation on the wrapped model; its cell."""
    wm, ctx = _STATE[backend]
    op = dict(OPS)[name]
    t0 = time.perf_counter()
    try:
        op(wm, ctx)
        result = _cell(True, t0)
    except Refused as refusal:
        result = {**_cell(True, t0), "refused": str(refusal)}
    except Exception as exc:
        result = _cell(False, t0, exc)
    _barrier()
    return result


def process_wide(model_name: str) -> dict[str, Any]:
    """Worker side: the operators DeepSpeed replaced for the whole process (``_torch_ops``), and
    what the replacement costs a plain model's no-grad forward here (its time over torch's own)."""
    from ..base.torch_ops import replaced_ops, torch_ops

    replaced = replaced_ops()
    if not replaced:
        return {"replaced": {}, "slowdown": None}
    model = any_model(model_name).eval()
    inputs, extra = model_inputs(model_name)

    def best(ctx: Callable[[], Any]) -> float:
        times = []
        for _ in range(5):
            with torch.no_grad(), ctx():
                t0 = time.perf_counter()
                model(inputs, **extra)
                times.append(time.perf_counter() - t0)
        return min(times)

    best(torch_ops)  # warm-up
    return {"replaced": replaced, "slowdown": best(contextlib.nullcontext) / best(torch_ops)}


def teardown_backend(backend: str) -> None:
    _STATE.pop(backend, None)
    release_kept_groups()
    import gc

    gc.collect()
    _barrier()


def cause_of(error: str) -> str:
    """One line saying what kind of failure an error line shows."""
    kind = error.split(":", 1)[0]
    return {
        "AssertionError": "wrong result",
        "MissingDependencyError": "a library is missing",
        "DistributedStateError": "process-group state",
        "PlacementError": "parameters on the wrong device",
        "UnsupportedModelError": "model not recognised",
        "MissingConfigError": "model has no config",
        "ReferenceModelError": "reference model",
        "WorkerError": "a rank failed or hung (timeout)",
        "NotImplementedError": "not supported on this backend",
    }.get(kind, "unexpected error")


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A live progress display in a terminal (rich when installed, plain lines otherwise), gone when
    done; nothing where the output is not a terminal (a log or a pipe keeps only the report)."""
    if not sys.stdout.isatty():
        yield lambda text: None
        return
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        done = [0]

        def plain(text: str) -> None:
            done[0] += 1
            print(f"  [{done[0]:>3}/{total}] {text}", flush=True)

        yield plain
        return
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("starting process group", total=total)

        def advance(text: str) -> None:
            bar.update(task, advance=1, description=text)

        yield advance


def _wrap_items(head: str, items: list[str]) -> str:
    """``head`` and the comma-separated ``items`` within the report's width, never breaking an item
    ("peft 0.21.2" stays on one line)."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > _WIDTH:
            lines.append(line)
            line = "    " + piece
        else:
            line = line + piece if line.endswith(" ") else line + " " + piece
    return "\n".join([*lines, line])


def _format_table(rows: dict[str, dict[str, Any]], columns: list[str]) -> str:
    """Operations down, backends across: milliseconds (the slowest rank's), FAIL, n/a where the stack
    refuses the operation as documented, or a dash where the backend did not run (the reasons for
    both are printed below the table)."""
    backends = list(rows)
    table = [["(ms)", *backends]]
    for col in columns:
        cells = [col]
        for backend in backends:
            cell = rows[backend].get(col)
            cells.append("-" if cell is None else "FAIL" if not cell["ok"] else "n/a" if cell.get("refused")
                         else f"{cell['ms']:.0f}")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    # Two spaces between columns, one where that would not fit the report's width.
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= _WIDTH else " "
    lines = [gap.join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in table]
    lines.insert(1, gap.join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _worst_of_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell fails if it failed on any rank; the time is the slowest rank's."""
    bad = next((r for r in per_rank if not r["ok"]), None)
    return {**(bad or per_rank[0]), "ms": max(r["ms"] for r in per_rank)}


def run_doctor(backends: list[str] | None = None, world_size: int = 2, json_path: str | None = None,
               verbose: bool = False, dtype: str = "fp32", topology: str = "flat", model: str = "llama") -> int:
    """Run the doctor; return the process exit code (non-zero on any failure)."""
    if topology != "flat" and (world_size < 4 or world_size % 2):
        print(f"wrapkit doctor: --topology {topology} needs --world-size 4 (two nodes of two), not {world_size}")
        return 2
    if model not in FAMILIES:
        print(f"wrapkit doctor: unknown --model {model!r}; known: {', '.join(FAMILIES)}")
        return 2
    if not is_available("transformers"):
        if model != "llama":
            print(f"wrapkit doctor: --model {model} needs transformers; install it with pip install 'wrapkit[all]'")
            return 2
        model = "toy"
    known = tuple(recipes())  # every registered backend with a recipe, in its recipe's order
    selected = backends or list(known)
    versions = {name: version_of(name) for name in ("torch", "deepspeed", "accelerate", "transformers", "peft")}
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    device = "cuda" if use_nccl else "cpu"
    print(_wrap_items("wrapkit doctor: ", [f"{k} {v or 'not installed'}" for k, v in versions.items()]))
    shown = {"toy": "toy MLP (transformers missing)", "llama": "transformers Llama (tiny, from a config)"}.get(
        model, f"transformers {model} (tiny, from a config)")
    print(f"model: {shown}; "
          f"{world_size} ranks, {'nccl' if use_nccl else 'gloo'} on {device}; dtype {dtype}; topology {topology}")
    op_names = [name for name, _ in OPS]
    columns = ["adapt", *op_names]
    rows: dict[str, dict[str, Any]] = {}
    wide: dict[str, Any] = {"replaced": {}, "slowdown": None}
    one_time: dict[str, dict[str, Any]] = {}  # the first DeepSpeed backend's library setup, measured apart
    # The workers' own output (torch FutureWarnings, DeepSpeed's notices) is kept out of the report.
    logs = tempfile.TemporaryDirectory(prefix="wrapkit-doctor-")
    runnable = [b for b in selected if b in known and (not (need := needs(b)) or is_available(need))]
    # Each worker imports the libraries up front; DeepSpeed (seconds per rank) only where a chosen backend takes it.
    wanted = ("transformers", "peft", *(["deepspeed"] if any(needs(b) == "deepspeed" for b in runnable) else []))
    group = WorkerGroup(world_size=world_size, backend="nccl" if use_nccl else "gloo",
                        preload=tuple(p for p in wanted if is_available(p)), log_dir=logs.name)
    t_start = time.perf_counter()
    try:
        with _progress(len(runnable) * len(columns)) as advance:
            for backend in selected:
                if backend not in known:
                    rows[backend] = {"_status": "FAIL", "_error": f"unknown backend; known: {', '.join(known)}"}
                    continue
                need = needs(backend)
                if need and not is_available(need):
                    rows[backend] = {"_status": f"not installed ({need})"}
                    continue
                why = supports(backend, topology)
                served, unserved = RECIPE_FAMILIES.get(backend, (None, ""))
                if why is None and served is not None and model not in served:
                    why = unserved.format(model=model)
                if why is not None:
                    rows[backend] = {"_status": "unsupported", "_why": why}
                    continue
                res: dict[str, Any] = {}
                rows[backend] = res
                try:
                    if need == "deepspeed" and not one_time:
                        one_time[backend] = _worst_of_ranks(group.run(deepspeed_setup, timeout=600))
                    res["adapt"] = _worst_of_ranks(group.run(setup_backend, backend, model, device, dtype,
                                                             topology, timeout=300))
                    advance(f"{backend}: adapt")
                    if not res["adapt"]["ok"]:
                        continue
                    for name in op_names:
                        res[name] = _worst_of_ranks(group.run(run_op, backend, name, timeout=_OP_TIMEOUT))
                        advance(f"{backend}: {name}")
                    group.run(teardown_backend, backend, timeout=60)
                except WorkerError as exc:
                    # The group was killed (a rank died or hung); the next backend starts a fresh one.
                    first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
                    missing = [c for c in columns if c not in res]
                    if missing:
                        res[missing[0]] = {"ok": False, "ms": _OP_TIMEOUT * 1e3, "error": f"WorkerError: {first}",
                                           "traceback": str(exc)}
        with contextlib.suppress(WorkerError):
            wide = group.run(process_wide, model, timeout=60)[0]
    finally:
        group.close()
        worker_output = _read_logs(logs.name)
        logs.cleanup()
    elapsed = time.perf_counter() - t_start
    print()
    print(_format_table(rows, columns))
    for backend, cell in one_time.items():
        state = f"{cell['ms'] / 1e3:.1f} s" if cell["ok"] else f"FAILED: {cell['error']}"
        print("\n" + textwrap.fill(f"one-time, before {backend}'s adapt (not in the table): {cell['what']}: {state}",
                                   _WIDTH))
    not_run = [f"{backend}: {res['_status']}" for backend, res in rows.items()
               if "_status" in res and res["_status"] not in ("FAIL", "unsupported")]
    if not_run:
        print("\nnot run: " + "; ".join(not_run))
    if worker_output and verbose:
        print(f"\noutput of the worker processes ({len(worker_output)} lines):")
        for line in worker_output:
            print("  " + line)
    elif worker_output:
        print("\n" + textwrap.fill(f"{len(worker_output)} lines of third-party output from the worker processes "
                                   "(warnings, notices) were kept out of this report; -v shows them.", _WIDTH))
    for op, by in wide["replaced"].items():
        cost = f"{wide['slowdown']:.2f}x the time of torch's own" if wide["slowdown"] else "a cost not measured"
        print("\n" + textwrap.fill(
            f"process-wide: DeepSpeed replaced {op} with {by} when ZeRO-3 was set up, for the whole process: a "
            f"plain model's forward here took {cost}. wrapkit's gathered(), generation() and the references it "
            "builds outside DeepSpeed run with torch's own; other models in the process (reward models, your "
            "own) do not.", _WIDTH))
    problems: list[str] = []
    for backend, res in rows.items():
        if res.get("_status") == "FAIL":
            problems.append(f"{backend}: {res['_error']}")
        for op, cell in res.items():
            if not op.startswith("_") and not cell["ok"]:
                problems.append(f"{backend}/{op}: {cause_of(cell['error'])} -- {cell['error']}")
                if verbose and cell["traceback"]:
                    problems.append("    " + cell["traceback"].replace("\n", "\n    "))
    skipped = [f"{backend}: {res['_why']}" for backend, res in rows.items() if "_why" in res]
    refused = [f"{backend}/{op}: {cell['refused']}" for backend, res in rows.items() for op, cell in res.items()
               if not op.startswith("_") and cell.get("refused")]
    for heading, lines in (("unsupported here", skipped), ("n/a, refused as documented", refused)):
        if lines:
            print(f"\n{heading} (not failures):")
            for line in lines:
                print(textwrap.fill(line, _WIDTH, initial_indent="  ", subsequent_indent="    "))
    failed = bool(problems)
    if problems:
        print("\nfailures:")
        for line in problems:
            print("  " + line)
    print(f"\n{'FAILED' if failed else 'all passed'} in {elapsed:.1f} s")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"versions": versions, "world_size": world_size, "device": device, "dtype": dtype,
                       "topology": topology, "model": model,
                       "elapsed_s": elapsed, "worker_output": worker_output, "process_wide": wide,
                       "one_time": one_time, "results": rows},
                      fh, indent=2, default=str)
    return 1 if failed else 0


def _read_logs(directory: str) -> list[str]:
    """The non-empty lines the workers printed, rank by rank, prefixed with the rank."""
    lines: list[str] = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), errors="replace") as fh:
            lines += [f"[{name.removesuffix('.log')}] {ln.rstrip()}" for ln in fh if ln.strip()]
    return lines
