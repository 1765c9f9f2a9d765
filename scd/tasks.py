"""Built-in verifiable tasks, a JSONL task, the character vocabulary and the reward.

A task is a fixed list of prompts, each with the answer a verifier compares
against.  The completion is exactly as long as the answer, so the reward is the
fraction of positions where the completion equals the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from scd.config import TaskConfig
from scd.errors import ConfigError

PAD, BOS, SEP = 0, 1, 2
_SPECIALS = 3
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=,.:;()[] "
VOCAB_SIZE = _SPECIALS + len(ALPHABET)
_INDEX = {ch: i + _SPECIALS for i, ch in enumerate(ALPHABET)}


def encode(text: str) -> list[int]:
    return [_INDEX[ch] for ch in text]


def decode(tokens: list[int]) -> str:
    return "".join(ALPHABET[t - _SPECIALS] if t >= _SPECIALS else "" for t in tokens)


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt_id: int
    text: str
    answer: str

    def prompt_tokens(self) -> list[int]:
        """BOS, the prompt, SEP: the model answers right after SEP."""
        return [BOS, *encode(self.text), SEP]

    def answer_tokens(self) -> list[int]:
        return encode(self.answer)


def reward(completion: list[int], answer: list[int]) -> float:
    """Fraction of answer positions the completion matches."""
    hits = sum(1 for got, want in zip(completion, answer, strict=False) if got == want)
    return hits / len(answer)


def build_task(config: TaskConfig) -> list[Prompt]:
    """The task's prompts, deterministic from ``config.seed``."""
    if config.name == "jsonl":
        return _load_jsonl(Path(config.path))
    rng = random.Random(config.seed)
    prompts = []
    for prompt_id in range(config.size):
        length = rng.randint(config.min_digits, config.max_digits)
        text = "".join(rng.choice("0123456789") for _ in range(length))
        answer = text[::-1] if config.name == "reverse" else "".join(sorted(text))
        prompts.append(Prompt(prompt_id, text, answer))
    return prompts


def _load_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = orjson.loads(line)
            text, answer = record["prompt"], record["answer"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ConfigError("task.path", f"{where}: need a JSON object with 'prompt' and 'answer'") from None
        if not isinstance(text, str) or not isinstance(answer, str) or not answer:
            raise ConfigError("task.path", f"{where}: 'prompt' and 'answer' must be strings, answer non-empty")
        unknown = set(text + answer) - set(ALPHABET)
        if unknown:
            raise ConfigError("task.path", f"{where}: characters outside the vocabulary: {sorted(unknown)}")
        prompts.append(Prompt(len(prompts), text, answer))
    if not prompts:
        raise ConfigError("task.path", f"{path} holds no prompts")
    return prompts
