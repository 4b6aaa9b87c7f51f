"""Write arithmetic_demos.jsonl: one demonstration per problem of arithmetic.jsonl.

Each line repeats the problem's "prompt" (so it matches the prompts file) and adds a
"response" in the format the prompts ask for: the number only. Deterministic; rerun with
    python recipes/data/make_arithmetic_demos.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "arithmetic.jsonl"
OUT = HERE / "arithmetic_demos.jsonl"


def main():
    problems = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = [json.dumps({"prompt": p["prompt"], "response": str(p["answer"])}) for p in problems]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} demonstrations to {OUT}")


if __name__ == "__main__":
    main()
