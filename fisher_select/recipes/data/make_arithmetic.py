"""Write arithmetic.jsonl: 64 short arithmetic word problems with integer answers.

Deterministic (random.Random(0)); rerunning regenerates the identical file:
    python recipes/data/make_arithmetic.py
"""

import json
import random
from pathlib import Path

N_PROBLEMS = 64
OUT = Path(__file__).with_name("arithmetic.jsonl")
SUFFIX = " Answer with the number only."
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Ivy"]
ITEMS = ["apples", "books", "coins", "pens", "stamps", "marbles", "cards", "shells"]


# Small numbers: a 135M model sampled at temperature 1 should be right sometimes, not never,
# so that rewards vary within a prompt and the RL signal scale is not zero.
def _add(rng):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b


def _sub(rng):
    a = rng.randint(3, 12)
    b = rng.randint(1, a - 1)  # keep answers positive
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b


def _mul(rng):
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    item = rng.choice(ITEMS)
    return f"There are {a} boxes with {b} {item} each. How many {item} in total?", a * b


def _div(rng):
    b, q = rng.randint(2, 4), rng.randint(2, 5)  # a = b * q divides exactly
    item = rng.choice(ITEMS)
    return f"{b * q} {item} are shared equally by {b} friends. How many does each get?", q


KINDS = [_add, _sub, _mul, _div]


def make_problems(n=N_PROBLEMS, seed=0):
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        question, answer = KINDS[i % len(KINDS)](rng)
        problems.append({"prompt": question + SUFFIX, "answer": answer})
    return problems


def main():
    lines = [json.dumps(p) for p in make_problems()]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} problems to {OUT}")


if __name__ == "__main__":
    main()
