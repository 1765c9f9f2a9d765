"""Writes this example's dataset: ``python examples/chat_reversal/make_data.py`` (no download).

Each row is a chat prompt asking to reverse four digits, its answer, and a column the reward gets as
``row``: 256 training rows (train.jsonl) and 64 held-out ones (eval.jsonl), none in both, the same on
every run of this script.
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
TRAIN, EVAL = 256, 64


def rows(numbers: list[int]) -> list[dict[str, object]]:
    return [{"prompt": [{"role": "user", "content": f"reverse {n:04d}"}], "answer": f"{n:04d}"[::-1],
             "palindrome": f"{n:04d}" == f"{n:04d}"[::-1]} for n in numbers]


def main() -> None:
    numbers = random.Random(0).sample(range(10_000), TRAIN + EVAL)
    for name, part in (("train.jsonl", numbers[:TRAIN]), ("eval.jsonl", numbers[TRAIN:])):
        (HERE / name).write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows(part)))


if __name__ == "__main__":
    main()
