"""Built-in verifiable tasks and a JSONL task: prompt text and answer text.

A task is a fixed list of prompts, each with the answer a verifier compares
against.  Tasks are text: the policy's tokenizer turns a prompt into tokens and
a completion back into text, and ``scd.rewards`` judges the text.  A completion
may use as many tokens as its answer has, so the default reward is the fraction
of answer positions the completion's text matches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from scd.config import TaskConfig
from scd.errors import ConfigError

# Built-in prompts end with this, so the model knows where its answer starts.
PROMPT_END = "="
# Skew telemetry keeps a counter per bucket and fate: a bucket field with more distinct values is refused.
MAX_FIELD_BUCKETS = 64


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt_id: int
    text: str  # exactly what the model is shown
    answer: str
    bucket: str = ""  # the value of ``task.bucket_field`` (a JSONL task's column), for skew telemetry


def build_task(config: TaskConfig) -> list[Prompt]:
    """The task's prompts, deterministic from ``config.seed``."""
    if config.name == "jsonl":
        return _load_jsonl(Path(config.path), config.bucket_field)
    rng = random.Random(config.seed)
    prompts = []
    for prompt_id in range(config.size):
        length = rng.randint(config.min_digits, config.max_digits)
        text = "".join(rng.choice("0123456789") for _ in range(length))
        answer = text[::-1] if config.name == "reverse" else "".join(sorted(text))
        prompts.append(Prompt(prompt_id, text + PROMPT_END, answer))
    return prompts


def _load_jsonl(path: Path, bucket_field: str) -> list[Prompt]:
    prompts: list[Prompt] = []
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
        prompts.append(Prompt(len(prompts), text, answer, _bucket_of(record, bucket_field, where)))
    if not prompts:
        raise ConfigError("task.path", f"{path} holds no prompts")
    buckets = {p.bucket for p in prompts}
    if len(buckets) > MAX_FIELD_BUCKETS:
        raise ConfigError("task.bucket_field", f"{path}: {bucket_field!r} has {len(buckets)} distinct values; skew "
                                               f"telemetry keeps counters per value, at most {MAX_FIELD_BUCKETS}: "
                                               "name a coarser column, or leave it empty to bucket by length")
    return prompts


def _bucket_of(record: dict[str, object], field: str, where: str) -> str:
    """A prompt's bucket: its ``field`` value as text ("" when no field is named)."""
    if not field:
        return ""
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError("task.bucket_field", f"{where}: needs a string or number field {field!r} "
                                               f"(the bucket of each prompt), got {value!r}")
    return str(value)
