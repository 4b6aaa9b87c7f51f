"""``fisher-select migrate``: upgrade a run directory written by an older release, in place."""

from __future__ import annotations

from fisher_select.commands import HELP



def register(subparsers) -> None:
    p = subparsers.add_parser("migrate", help=HELP["migrate"],
                              description="Rewrite a run directory's report.json to this release's run format "
                                          "(atomically; tensors are not touched).")
    p.add_argument("run", help="run directory written by `fisher-select calibrate`")
    p.set_defaults(func=main)


def main(args) -> int:
    from fisher_select.rundir import FORMAT_VERSION, load_run, migrate

    migrate(args.run)
    run = load_run(args.run)  # proves the result loads
    print(f"{args.run}: run {run.run_id} is in run format {FORMAT_VERSION}")
    return 0
