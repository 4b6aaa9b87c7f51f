"""`fisher-select compare RUN_A RUN_B [...]`: runs side by side, with the agreement of their Fishers."""

from __future__ import annotations

from fisher_select.commands import HELP

import json
from pathlib import Path



def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help=HELP["compare"],
        description="Compare two or more run directories (two objectives, two models, two seeds): each run's "
                    "numbers, and for every pair the Jaccard overlap of their top-1% and top-10% coordinate masks "
                    "(same parameters only) and the Spearman correlation of their module masses.")
    p.add_argument("runs", nargs="+", help="two or more run directories")
    p.add_argument("--json", dest="json_out", default=None, help="also write the comparison as JSON to this file")
    p.set_defaults(func=main)


def main(args) -> int:
    from fisher_select.atomic import write_file
    from fisher_select.errors import FisherSelectError
    from fisher_select.report.compare import compare, comparison_lines

    if len(args.runs) < 2:
        raise FisherSelectError("compare needs at least two run directories")
    result = compare(args.runs)
    for line in comparison_lines(result):
        print(line)
    if args.json_out:
        text = json.dumps(result.to_json(), indent=2) + "\n"
        write_file(Path(args.json_out), lambda tmp: tmp.write_text(text), overwrite=True)
        print(f"wrote {args.json_out}")
    return 0
