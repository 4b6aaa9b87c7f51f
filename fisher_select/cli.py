"""`fisher-select`: a thin layer over the Python API. User errors print as one line, exit 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from fisher_select import commands
from fisher_select.commands import HELP
from fisher_select.version import __version__
from fisher_select.atomic import Terminated, raise_on_sigterm
from fisher_select.errors import FisherSelectError, ResourceError


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. Only the command named in ``argv`` is imported and gets its arguments; the
    others are listed by name and help, so ``--version``, ``--help`` and a mistyped command answer
    without loading torch."""
    parser = argparse.ArgumentParser(prog="fisher-select", description="Locate the coordinates fine-tuning is likely to move: exact model Fisher, signal scales, bounds, masks and PEFT hints.")
    parser.add_argument("--version", action="version", version=f"fisher-select {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _command_in(sys.argv[1:] if argv is None else argv)
    for name, help_text in sorted(HELP.items()):
        if name == chosen:
            importlib.import_module(f"{commands.__name__}.{name}").register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


# Third-party messages a user cannot act on. bitsandbytes warns on every CPU with AVX512-BF16 that an
# optional hub kernel is missing (fetching it would be a network access; its CPU fallback is used).
_QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def quiet_third_party_loggers() -> None:
    """Raise ``_QUIET_LOGGERS`` to ERROR. Entry points call it (the CLI, bench scripts), never an import:
    a library does not reconfigure another's loggers."""
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_loggers()  # before the commands import peft, which imports bitsandbytes
    args = build_parser(argv).parse_args(argv)
    args.command_line = ["fisher-select", *(sys.argv[1:] if argv is None else argv)]  # recorded in the run
    raise_on_sigterm()  # a cluster time limit stops the work like Ctrl-C: nothing half-written stays
    try:
        return int(args.func(args) or 0)
    except FisherSelectError as exc:  # the user's input (2) or the machine (1): what, where, what to do
        if args.debug:
            raise
        print(f"fisher-select: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ResourceError) else 2
    except OSError as exc:  # the environment: disk full, permissions, a path that cannot be created
        if args.debug:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"fisher-select: error: {exc.strerror or exc}{where}; nothing was written "
              "(free space, fix permissions or choose another --out)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fisher-select: interrupted (SIGINT); nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("fisher-select: terminated (SIGTERM); nothing was written", file=sys.stderr)
        return 143
    except Exception as exc:  # a bug: one line, the traceback with --debug
        if args.debug:
            raise
        print(f"fisher-select: internal error: {type(exc).__name__}: {exc}; rerun with --debug for the "
              "traceback and please report it", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
