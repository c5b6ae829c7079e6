"""``wrapkit bench``: run the scripts in ``benchmarks/`` and report their ratios.

Each benchmark script defines ``NAME`` and ``run(quick: bool = False) -> list[dict]``;
every dict is one case measured side by side in one run::

    {"case": "ddp", "wrapkit": 0.0123, "baseline": 0.0122, "unit": "s",
     "ratio": 1.008, "goal": 1.01, "better": "lower", "note": "..."}

``better`` says which way the goal points: ``"lower"`` (ratio <= goal) or
``"higher"`` (ratio >= goal). ``"stderr"`` (optional) is the ratio's standard error: a goal missed by
less than two of them is reported as within the noise, not as a miss. ``"baseline_is_floor": True``
marks a baseline that is the physical minimum (generation: the unsharded model plus one bare gather);
the plot draws it as a line.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

__all__ = ["find_benchmarks", "run_bench", "met", "verdict"]

# How many standard errors a missed goal must be missed by to count as a miss.
NOISE_SE = 2.0
_COLOURS = {"yes": "tab:green", "noise": "tab:orange", "NO": "tab:red"}
_MEANING = {"yes": "meets the goal", "noise": f"misses by less than {NOISE_SE:g} s.e. (noise)",
            "NO": "misses the goal"}


def find_benchmarks(directory: str | Path | None = None) -> Path:
    """``benchmarks/`` beside the package (a source checkout) or in the working directory."""
    candidates = [Path(directory)] if directory else [
        Path.cwd() / "benchmarks",
        Path(__file__).resolve().parent.parent.parent / "benchmarks",
    ]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.py")):
            return path
    raise FileNotFoundError(
        "no benchmarks/ directory found (looked in " + ", ".join(str(c) for c in candidates) + "). The benchmarks "
        "are not part of the installed package: they ship in the source distribution and the repository. Unpack "
        "the sdist (`pip download --no-deps --no-binary :all: wrapkit`) or clone the repository, then run "
        "`wrapkit bench` there, or pass --dir PATH/benchmarks."
    )


def met(row: dict[str, Any]) -> bool:
    ratio, goal = float(row["ratio"]), float(row["goal"])
    return ratio >= goal if row.get("better") == "higher" else ratio <= goal


def verdict(row: dict[str, Any]) -> str:
    """``"yes"`` (goal met), ``"noise"`` (missed by less than ``NOISE_SE`` standard errors) or ``"NO"``."""
    if met(row):
        return "yes"
    stderr = row.get("stderr")
    if stderr is not None and abs(float(row["ratio"]) - float(row["goal"])) <= NOISE_SE * float(stderr):
        return "noise"
    return "NO"


def _ratio_text(row: dict[str, Any]) -> str:
    stderr = row.get("stderr")
    return f"{row['ratio']:.3g}" + (f" +/- {stderr:.2g}" if stderr is not None else "")


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = [f"{r['benchmark']}\n{r['case']}" for r in rows]
    # Normalise so that every goal sits at 1.0 and "better" is always below it; a log axis, so that a
    # 1000x speed-up and a 2% overhead both show.
    values = [
        max((r["goal"] / r["ratio"] if r.get("better") == "higher" else r["ratio"] / r["goal"]) if r["ratio"] else 0.0,
            1e-4)
        for r in rows
    ]
    verdicts = [verdict(r) for r in rows]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(rows)), 5.0))
    bars = ax.bar(range(len(rows)), values, color=[_COLOURS[v] for v in verdicts])
    ax.set_yscale("log")
    for bar, r in zip(bars, rows, strict=True):  # the measured ratio itself on each bar
        ax.annotate(_ratio_text(r), (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=6, rotation=90)
    handles: list[Any] = [Patch(color=_COLOURS[v], label=_MEANING[v]) for v in _COLOURS if v in verdicts]
    handles.append(ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="goal"))
    # Rows measured against a physical floor (``baseline_is_floor``): the floor itself, ratio 1,
    # drawn across the bar, so that the distance left to it shows.
    floors = [i for i, r in enumerate(rows) if r.get("baseline_is_floor") and r.get("better") != "higher"]
    for i in floors:
        line = ax.hlines(1.0 / rows[i]["goal"], i - 0.45, i + 0.45, color="tab:blue", linewidth=2,
                         label="physical floor")
    if floors:
        handles.append(line)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ratio / goal (log; lower is better, <= 1 meets the goal)")
    ax.set_title("wrapkit bench: bars are ratio / goal, labels the ratio itself (+/- 1 s.e.)")
    ax.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    sized = [r for r in rows if "size_mb" in r]
    if sized:
        _plot_sizes(plt, sized, path)


def _plot_sizes(plt: Any, rows: list[dict[str, Any]], path: str) -> str:
    """Time and peak memory of each operation against the model's size (the scale benchmark),
    beside ``path`` as ``<stem>-scale.png``; returns that path."""
    out = str(Path(path).with_name(Path(path).stem + "-scale.png"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size_mb"])
        sizes = [r["size_mb"] for r in mine]
        left.plot(sizes, [r["seconds"] for r in mine], marker="o", label=op)
        right.plot(sizes, [r["peak_mb"] for r in mine], marker="o", label=op)
    sizes = sorted({r["size_mb"] for r in rows})
    right.plot(sizes, sizes, color="black", linestyle="--", linewidth=1, label="the whole model")
    right.plot(sizes, [x / 2 for x in sizes], color="grey", linestyle=":", linewidth=1, label="1/N of it (N=2)")
    for ax, label in ((left, "seconds"), (right, "per-rank peak memory (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model size (MB of fp32 weights)")
        ax.set_ylabel(label)
    right.legend(fontsize=7)
    fig.suptitle("wrapkit bench scale")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot written to {out}")
    return out


def _format(rows: list[dict[str, Any]]) -> str:
    header = ["benchmark", "case", "wrapkit", "baseline", "ratio +/- s.e.", "goal", "met"]
    table = []
    for r in rows:
        unit = r.get("unit", "s")
        goal = ("<= " if r.get("better") != "higher" else ">= ") + f"{r['goal']:g}"
        table.append([
            r["benchmark"], str(r["case"]), f"{r['wrapkit']:.4g} {unit}", f"{r['baseline']:.4g} {unit}",
            _ratio_text(r), goal, verdict(r),
        ])
    widths = [max(len(x[i]) for x in [header, *table]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*t) for t in table)])


def _count_warnings(log_dir: str) -> int:
    """Warning lines the workers printed into their log files."""
    count = 0
    for path in Path(log_dir).glob("*.log"):
        count += sum(1 for line in path.read_text(errors="replace").splitlines() if "Warning: " in line)
    return count


def _show_worker_output(log_dir: str) -> None:
    """The end of each worker's log, after a failure: the cause is often there."""
    for path in sorted(Path(log_dir).glob("*.log")):
        text = path.read_text(errors="replace").strip()
        if text:
            print(f"   --- {path.name} (last lines)\n" + "\n".join(text.splitlines()[-20:]), flush=True)


def run_bench(names: list[str] | None = None, *, directory: str | None = None, json_path: str | None = None,
              plot_path: str | None = None, quick: bool = False, verbose: bool = False) -> int:
    """Run the selected benchmarks (default: all); return 0, or 1 if one could not run.

    Unless ``verbose``, third-party warnings are kept out of the report: those raised here are
    counted, and the worker processes' output goes to files, shown only when a benchmark fails.
    """
    bench_dir = find_benchmarks(directory)
    available = sorted(p.stem for p in bench_dir.glob("*.py") if not p.stem.startswith("_"))
    selected = names or available
    unknown = [n for n in selected if n not in available]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    # Worker processes import the benchmark module by name, so its folder must be importable.
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    logs = None if verbose else tempfile.TemporaryDirectory(prefix="wrapkit-bench-")
    if logs is not None:
        os.environ["WRAPKIT_BENCH_LOGS"] = logs.name
    caught: list[warnings.WarningMessage] = []
    try:
        for name in selected:
            print(f"== {name}", flush=True)
            try:
                with warnings.catch_warnings(record=not verbose) as seen:
                    if not verbose:
                        warnings.simplefilter("always")
                    module = importlib.import_module(name)
                    for row in module.run(quick=quick):
                        row = {"benchmark": name, **row}
                        rows.append(row)
                        print(f"   {row['case']}: ratio {_ratio_text(row)} (goal {row['goal']:g})", flush=True)
                caught += seen or []
            except Exception as exc:  # a benchmark that breaks is reported, the others still run
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"   failed: {type(exc).__name__}: {exc}", flush=True)
                if logs is not None:
                    _show_worker_output(logs.name)
        quiet = len(caught) + (_count_warnings(logs.name) if logs is not None else 0)
    finally:
        if logs is not None:
            os.environ.pop("WRAPKIT_BENCH_LOGS", None)
            logs.cleanup()
    if quiet:
        print(f"({quiet} warnings from torch and other libraries were kept out of this report; -v shows them)")
    print()
    if rows:
        print(_format(rows))
    for line in failed:
        print("FAILED " + line)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"results": rows, "failed": failed}, fh, indent=2)
    if plot_path and rows:
        _plot(rows, plot_path)
        print(f"plot written to {plot_path}")
    return 1 if failed else 0
