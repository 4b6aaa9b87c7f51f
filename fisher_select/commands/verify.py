"""``fisher-select verify``: do two run directories hold the same result, tensor by tensor?

Files differ between two runs even with the same seed (the run id and time in their metadata),
so this compares contents: every tensor bit for bit, the samples and the report first, then,
apart, the environment they were made in (library versions, Python, platform).
"""

from __future__ import annotations

from fisher_select.commands import HELP


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help=HELP["verify"],
                              description="Compare two runs' tensors bit for bit, their samples and reports (run id, "
                                          "time, command line and environment aside), then their environments. Exit "
                                          "0 when the results are identical (a warning lists any library whose "
                                          "version differs), 1 when they differ, listing each difference.")
    p.add_argument("run_a", help="a run directory")
    p.add_argument("run_b", help="another run directory")
    p.set_defaults(func=main)


def main(args) -> int:
    from fisher_select.run.verify import compare_runs

    diff = compare_runs(args.run_a, args.run_b)
    for line in diff.results:
        print(line)
    pair = f"{args.run_a} and {args.run_b}"
    if diff.identical_results:
        print(f"{pair}: identical results (every tensor bit for bit, the samples and the report)")
    else:
        print(f"{pair}: {len(diff.results)} difference(s) in the results")
    if diff.environment:
        print(f"warning: made in different environments ({'; '.join(diff.environment)})"
              + (": the results agree regardless" if diff.identical_results else
                 ": a library version can change the numbers"))
    return 0 if diff.identical_results else 1
