"""`fisher-select report RUN`: report.json, report.md and report.html again from a run directory."""

from __future__ import annotations

from fisher_select.commands import HELP, add_command


def register(subparsers) -> None:
    add_command(
        subparsers, "report", main, help=HELP["report"],
        description="Recompute the report's statistics from the run's files (F, gradient estimates, S, samples, "
                    "per-prompt scale terms) and redraw the pages; nothing is sampled or scored again. Statistics "
                    "that need the sampling pass (score-mean check, split halves, per-batch spread) are kept "
                    "as written. Each file is replaced atomically.",
        run_help="a run directory (the --out of `fisher-select calibrate`)")


def main(args) -> int:
    from fisher_select.run_report import regenerate

    for path in regenerate(args.run):
        print(f"wrote {path}")
    return 0
