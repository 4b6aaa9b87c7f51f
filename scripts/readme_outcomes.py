"""Rewrite the README's outcomes block (between <!-- outcomes:begin --> and <!-- outcomes:end -->) from the
protocol 2 records in bench/results (fisher_select.report.readme_outcomes), and the lr advice that `select`
and `lora` print (fisher_select/report/study_advice.json, fisher_select.report.study_advice) from the same records.

    python scripts/readme_outcomes.py README.md                # rewrite the block
    python scripts/readme_outcomes.py README.md --check        # exit 1 if the block is stale
    python scripts/readme_outcomes.py --print                  # print the block only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fisher_select.atomic import write_file
from fisher_select.errors import FisherSelectError
from fisher_select.report.readme_outcomes import BEGIN, END, protocol2_records, readme_block, rewrite_block

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("readme", nargs="?", help="the file holding the markers (README.md)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), help="the folder of outcomes-<kind>.json")
    p.add_argument("--advice", default=str(ROOT / "fisher_select" / "report" / "study_advice.json"),
                   help="the lr advice file written beside the block")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the block or the advice is stale")
    p.add_argument("--print", action="store_true", help="print the block and exit")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except FisherSelectError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def advice_text(results) -> str:
    """The lr advice file's text from the protocol 2 records under ``results``."""
    from fisher_select.report.study_advice import advice_from_records

    records = {r.kind: r for r in protocol2_records(results)}
    return json.dumps(advice_from_records(records), indent=1, sort_keys=True) + "\n"


def _run(args) -> int:
    block = readme_block(args.results)
    if args.print or not args.readme:
        print(block)
        return 0
    advice, advice_path = advice_text(args.results), Path(args.advice)
    if args.check:
        text = Path(args.readme).read_text(encoding="utf-8")
        stale = f"{BEGIN}\n{block}\n{END}" not in text
        stale_advice = not advice_path.is_file() or advice_path.read_text(encoding="utf-8") != advice
        print(f"{args.readme}: the outcomes block is {'stale' if stale else 'up to date'}; "
              f"{advice_path.name} is {'stale' if stale_advice else 'up to date'}")
        return int(stale or stale_advice)
    print(f"{args.readme}: {'rewritten' if rewrite_block(args.readme, block) else 'unchanged'}")
    write_file(advice_path, lambda tmp: tmp.write_text(advice, encoding="utf-8"), overwrite=True)
    print(f"{advice_path}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
