"""Write hidden_rule.jsonl and hidden_rule_demos.jsonl: 512 sums under a rule the model cannot know.

"In Zed's arithmetic, what is a ⊕ b?" has the answer a + b + 1. Nothing in the prompt says so: the
rule is learned from the demonstrations or not at all. On the arithmetic files a model can win
most of its gain by learning the answer's format ("the number only"), which any few coordinates
learn at a large enough learning rate; here the same format carries a content change that every
held-out problem tests (the answer-token NLL and greedy accuracy), so a selection rule has
something to get right. Operands 2..25 (576 pairs), 512 drawn without replacement, so no problem
repeats. Deterministic (random.Random(0)); rerunning regenerates the identical files:
    python recipes/data/make_hidden_rule.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "hidden_rule.jsonl"
DEMOS = HERE / "hidden_rule_demos.jsonl"
N_PROBLEMS = 512
LOW, HIGH = 2, 25
OFFSET = 1  # the hidden rule: a ⊕ b = a + b + OFFSET


def make_problems(n=N_PROBLEMS, seed=0) -> list[dict]:
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]  # (576,)
    chosen = random.Random(seed).sample(pairs, n)  # without replacement: distinct problems
    return [{"prompt": f"In Zed's arithmetic, what is {a} ⊕ {b}? Answer with the number only.",
             "answer": a + b + OFFSET} for a, b in chosen]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main():
    problems = make_problems()
    _write(OUT, problems)
    _write(DEMOS, [{"prompt": p["prompt"], "response": str(p["answer"])} for p in problems])
    print(f"wrote {len(problems)} problems to {OUT} and their demonstrations to {DEMOS}")


if __name__ == "__main__":
    main()
