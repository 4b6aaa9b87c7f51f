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
    from fisher_select.run.load import load_run
    from fisher_select.run.migrate import migrate
    from fisher_select.run.schema import FORMAT_VERSION

    migrate(args.run)
    run = load_run(args.run)  # proves the result loads
    print(f"{args.run}: run {run.run_id} is in run format {FORMAT_VERSION}")
    return 0
