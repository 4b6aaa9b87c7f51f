"""`fisher-select report RUN`: report.json, report.md and report.html again from a run directory."""

from __future__ import annotations

from fisher_select.commands import HELP, add_command


def register(subparsers) -> None:
    p = add_command(
        subparsers, "report", main, help=HELP["report"],
        description="Redraw report.md and report.html (and rewrite report.json) from the run's report.json: "
                    "no tensor is read, nothing is sampled or scored again. With --recompute, the statistics are "
                    "first recomputed from the run's files (F, gradient estimates, S, samples, per-prompt scale "
                    "terms); those that need the sampling pass (score-mean check, split halves, per-batch spread) "
                    "are kept as written. Each file is replaced atomically.",
        run_help="a run directory (the --out of `fisher-select calibrate`)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute the statistics from the run's tensors first (reads every tensor file)")


def main(args) -> int:
    from fisher_select.report.build import regenerate

    for path in regenerate(args.run, recompute=args.recompute):
        print(f"wrote {path}")
    return 0
