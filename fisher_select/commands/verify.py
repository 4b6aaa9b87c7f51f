"""``fisher-select verify``: do two run directories hold the same result, tensor by tensor?

Files differ between two runs even with the same seed (the run id and time in their metadata),
so this compares contents: every tensor bit for bit, the samples, and the report.
"""

from __future__ import annotations

from fisher_select.rundir import compare_runs


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="compare two run directories tensor by tensor (reproducibility)",
                              description="Exit 0 when two runs hold bit-identical tensors, samples and report "
                                          "(run id, time and command line aside), 1 otherwise, listing each difference.")
    p.add_argument("run_a", help="a run directory")
    p.add_argument("run_b", help="another run directory")
    p.set_defaults(func=main)


def main(args) -> int:
    diffs = compare_runs(args.run_a, args.run_b)
    for line in diffs:
        print(line)
    print(f"{args.run_a} and {args.run_b}: " + ("identical results" if not diffs else f"{len(diffs)} difference(s)"))
    return 1 if diffs else 0
