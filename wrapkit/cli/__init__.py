"""Command line: ``wrapkit doctor``, ``wrapkit bench`` and ``wrapkit vendor``."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap

__all__ = ["main"]


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help in 100 columns at most, whatever the terminal, with names such as ``llama-reward`` and
    ``--world-size`` never broken at their hyphens."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=min(100, shutil.get_terminal_size().columns), max_help_position=24)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(" ".join(part.split()), width, initial_indent=indent, subsequent_indent=indent,
                                       break_on_hyphens=False) if not part.startswith(" ") else part
                         for part in text.split("\n"))


def main(argv: list[str] | None = None) -> int:
    from ..base.version import __version__

    parser = argparse.ArgumentParser(prog="wrapkit", description="One protocol over distributed model wrappers.",
                                     formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"wrapkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="run every operation on every installed backend and print a table",
                         formatter_class=_Help,
                         description="Start real process groups on this machine, wrap a tiny model with every "
                                     "installed backend, run every operation and print a table of the results.")
    doc.add_argument("--backends", metavar="LIST", help="comma-separated subset, e.g. ddp,zero3 (default: all)")
    doc.add_argument("--world-size", type=int, default=2, metavar="N",
                     help="ranks to start (default 2; the hsdp and tp topologies need 4)")
    doc.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                     help="fp32 weights, or each backend's bf16 mixed precision")
    doc.add_argument("--topology", choices=("flat", "hsdp", "tp"), default="flat",
                     help="one group; a 2-D replicate x shard layout (needs --world-size 4); or fsdp2 over dp "
                          "beside tensor parallelism over tp of a (dp, tp) mesh (needs --world-size 4)")
    doc.add_argument("--model", default="llama", metavar="FAMILY",
                     help="the tiny model wrapped, built from a config: llama (default), qwen2-tied, gemma3, "
                          "qwen3-moe, gpt-oss, deepseek-v3, qwen2-vl, llava, t5 or llama-reward")
    doc.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON")
    doc.add_argument("-v", "--verbose", action="store_true",
                     help="print the full traceback of each failure, and what the workers printed")
    ben = sub.add_parser("bench", help="run the benchmarks in benchmarks/ and print their ratios",
                         description="Run the benchmarks, each measuring wrapkit and the alternative side by side "
                                     "in one run, and print each ratio against its goal.",
                         epilog=_benchmark_list(), formatter_class=_Help)
    ben.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    ben.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    ben.add_argument("--plot", dest="plot_path", metavar="PNG", help="bar chart of the ratios against their goals")
    ben.add_argument("--dir", dest="directory", help="the benchmarks folder (default: ./benchmarks)")
    ben.add_argument("--quick", action="store_true", help="fewer repetitions, for smoke tests")
    ben.add_argument("-v", "--verbose", action="store_true",
                     help="show the warnings and the workers' output that are otherwise kept out")
    ven = sub.add_parser("vendor", help="copy the package into another project", formatter_class=_Help,
                         description="Copy the package into another project's tree, with its license and a "
                                     "VENDORED note. Its imports are relative, so the copy works under any "
                                     "parent package.")
    ven.add_argument("dest", help="the directory to copy into: the copy is DEST/NAME")
    ven.add_argument("--name", default=None, help="the copy's directory name (default: wrapkit)")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (FileNotFoundError, FileExistsError) as exc:  # what the user must fix, not a crash
        print(f"wrapkit {args.command}: {exc}", file=sys.stderr)
        return 2


def _benchmark_list() -> str:
    """The benchmarks ``bench`` can run, each with the first line of its docstring, for ``--help``."""
    import ast

    from .bench import find_benchmarks

    try:
        directory = find_benchmarks()
    except FileNotFoundError as exc:
        return f"benchmarks: {exc}"
    lines = ["benchmarks (in " + str(directory) + "):"]
    for path in sorted(directory.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        except (OSError, SyntaxError, ValueError):
            doc = ""
        first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].rstrip(".:").replace("``", "")
        # Whole, wrapped under its name: help is read in a terminal of 100 columns.
        lines += textwrap.wrap(first, 100, initial_indent=f"  {path.stem:<18} ", subsequent_indent=" " * 21)
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from .doctor import run_doctor

        backends = [b.strip() for b in args.backends.split(",")] if args.backends else None
        return run_doctor(backends, world_size=args.world_size, json_path=args.json_path, verbose=args.verbose,
                          dtype=args.dtype, topology=args.topology, model=args.model)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args.names or None, directory=args.directory, json_path=args.json_path,
                         plot_path=args.plot_path, quick=args.quick, verbose=args.verbose)
    if args.command == "vendor":
        from .vendor import vendor

        print(vendor(args.dest, args.name))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
