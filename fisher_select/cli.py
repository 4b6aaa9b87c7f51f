"""`fisher-select`: a thin layer over the Python API. User errors print as one line, exit 2."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from fisher_select import commands
from fisher_select.errors import FisherSelectError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fisher-select", description="Locate the coordinates fine-tuning is likely to move: exact model Fisher, signal scales, bounds, masks and PEFT hints.")
    sub = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FisherSelectError as exc:
        print(f"fisher-select: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fisher-select: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
