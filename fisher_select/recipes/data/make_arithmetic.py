"""Write arithmetic.jsonl: 512 distinct short arithmetic word problems with integer answers.

Drawn without replacement: a problem whose normalized text (``normalize``: case and spacing
folded) is already in the file is drawn again, from wider ranges, so no problem appears twice and
the first rows (up to the first repeat of the old with-replacement draw, row 22) stay those of
earlier versions of this file, which the shipped recipes calibrate on. Kinds cycle add, subtract,
multiply, divide. Deterministic (random.Random(0)); rerunning regenerates the identical file:
    python recipes/data/make_arithmetic.py
"""

import json
import random
from pathlib import Path

N_PROBLEMS = 512
OUT = Path(__file__).with_name("arithmetic.jsonl")
SUFFIX = " Answer with the number only."
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Ivy"]
ITEMS = ["apples", "books", "coins", "pens", "stamps", "marbles", "cards", "shells"]
MAX_TRIES = 10_000  # redraws of one problem before giving up (the wide ranges hold hundreds per kind)


# Small numbers: a 135M model sampled at temperature 1 should be right sometimes, not never,
# so that rewards vary within a prompt and the RL signal scale is not zero. The wide ranges (used
# only to redraw a repeat) keep every answer below 22, so the chat examples (answers 22, 34, 42)
# give none away.
def _add(rng, wide):
    top = 10 if wide else 9
    a, b = rng.randint(1, top), rng.randint(1, top)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b


def _sub(rng, wide):
    a = rng.randint(3, 20 if wide else 12)
    b = rng.randint(1, a - 1)  # keep answers positive
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b


def _mul(rng, wide):
    top = 6 if wide else 5  # products of 2..6 never equal 22, 34 or 42
    a, b = rng.randint(2, top), rng.randint(2, top)
    item = rng.choice(ITEMS)
    return f"There are {a} boxes with {b} {item} each. How many {item} in total?", a * b


def _div(rng, wide):
    b, q = (rng.randint(2, 6), rng.randint(2, 9)) if wide else (rng.randint(2, 4), rng.randint(2, 5))
    item = rng.choice(ITEMS)
    return f"{b * q} {item} are shared equally by {b} friends. How many does each get?", q


KINDS = [_add, _sub, _mul, _div]


def normalize(text: str) -> str:
    """The text two prompts are compared on: lower case, runs of whitespace as one space."""
    return " ".join(text.lower().split())


def make_problems(n=N_PROBLEMS, seed=0):
    rng = random.Random(seed)
    problems, seen = [], set()
    for i in range(n):
        for attempt in range(MAX_TRIES):
            question, answer = KINDS[i % len(KINDS)](rng, wide=attempt > 0)
            if normalize(question) not in seen:
                break
        else:
            raise RuntimeError(f"no new {KINDS[i % len(KINDS)].__name__} problem after {MAX_TRIES} draws")
        seen.add(normalize(question))
        problems.append({"prompt": question + SUFFIX, "answer": answer})
    return problems


def main():
    lines = [json.dumps(p) for p in make_problems()]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} problems to {OUT}")


if __name__ == "__main__":
    main()
