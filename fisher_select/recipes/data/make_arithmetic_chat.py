"""Write arithmetic_chat.jsonl: the problems of arithmetic.jsonl as short chats with three solved examples.

Each line keeps the problem's "answer" and gives "messages": a system message asking for one
number, three solved problems (not in arithmetic.jsonl) as earlier turns, then the problem. The
examples teach a 135M model to answer with a number and stop, so almost every sampled response
ends with EOS well before max_new_tokens (a truncated response is not a full sample of the
model). Deterministic; rerun with
    python recipes/data/make_arithmetic_chat.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "arithmetic.jsonl"
OUT = HERE / "arithmetic_chat.jsonl"
SYSTEM = "You are a calculator. Reply with one number and nothing else."
SUFFIX = " Answer with the number only."
# Names and answers that arithmetic.jsonl never uses (its answers stay below 22 or are products of
# 2..6), so no example gives away a problem's answer.
EXAMPLES = [
    ("Tom has 13 apples and gets 21 more. How many apples now?", "34"),
    ("There are 6 boxes with 7 pens each. How many pens in total?", "42"),
    ("Sue has 30 cards and gives away 8. How many cards are left?", "22"),
]


def chat(problem: dict) -> dict:
    turns = [{"role": "system", "content": SYSTEM}]
    for question, answer in EXAMPLES:
        turns += [{"role": "user", "content": question + SUFFIX}, {"role": "assistant", "content": answer}]
    turns.append({"role": "user", "content": problem["prompt"]})
    return {"messages": turns, "answer": problem["answer"]}


def main():
    problems = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    OUT.write_text("".join(json.dumps(chat(p)) + "\n" for p in problems), encoding="utf-8")
    print(f"wrote {len(problems)} chats to {OUT}")


if __name__ == "__main__":
    main()
