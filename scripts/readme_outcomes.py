"""Rewrite the README's outcomes block (between <!-- outcomes:begin --> and <!-- outcomes:end -->) from the
protocol 2 records in bench/results (fisher_select.report.readme_outcomes).

    python scripts/readme_outcomes.py README.md                # rewrite the block
    python scripts/readme_outcomes.py README.md --check        # exit 1 if the block is stale
    python scripts/readme_outcomes.py --print                  # print the block only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fisher_select.errors import FisherSelectError
from fisher_select.report.readme_outcomes import BEGIN, END, readme_block, rewrite_block

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("readme", nargs="?", help="the file holding the markers (README.md)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), help="the folder of outcomes-<kind>.json")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the block is stale")
    p.add_argument("--print", action="store_true", help="print the block and exit")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except FisherSelectError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    block = readme_block(args.results)
    if args.print or not args.readme:
        print(block)
        return 0
    if args.check:
        text = Path(args.readme).read_text(encoding="utf-8")
        stale = f"{BEGIN}\n{block}\n{END}" not in text
        print(f"{args.readme}: the outcomes block is {'stale' if stale else 'up to date'}")
        return int(stale)
    print(f"{args.readme}: {'rewritten' if rewrite_block(args.readme, block) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
