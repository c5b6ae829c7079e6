"""Command line: ``wrapkit doctor`` and ``wrapkit vendor``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wrapkit", description="One protocol over distributed model wrappers.")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="run every operation on every installed backend and print a table")
    doc.add_argument("--backends", help="comma-separated subset, e.g. ddp,zero3")
    doc.add_argument("--world-size", type=int, default=2)
    doc.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON")
    ven = sub.add_parser("vendor", help="copy the package into another project")
    ven.add_argument("dest")
    ven.add_argument("--name", default=None, help="directory name of the copy (default: the package's)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run_doctor

        backends = [b.strip() for b in args.backends.split(",")] if args.backends else None
        return run_doctor(backends, world_size=args.world_size, json_path=args.json_path)
    if args.command == "vendor":
        from .vendor import vendor

        print(vendor(args.dest, args.name))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
