"""The task's prompts: built-in verifiable tasks, or a dataset file (JSONL or Parquet).

A task is a fixed list of prompts, each with the answer a verifier compares
against.  A built-in prompt is a digit string the model is shown as raw text.  A
dataset row's prompt field is text or chat messages, its answer field any JSON
value, and its other columns travel with it for the rewards; ``scd.model.prompts``
renders each prompt to token ids once.  Until rewards are configurable, a
completion may use as many tokens as a text answer has, and the reward is the
fraction of answer positions the completion's text matches.
"""

from __future__ import annotations

import base64
import datetime
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from scd.config import TaskConfig
from scd.errors import ConfigError

# Built-in prompts end with this, so the model knows where its answer starts.
PROMPT_END = "="
# Skew telemetry keeps a counter per bucket and fate: a bucket field with more distinct values is refused.
MAX_FIELD_BUCKETS = 64
BUILTIN_TASKS = frozenset({"reverse", "sort"})

# A dataset's prompt field as given: text, or chat messages ({"role", "content"}).
PromptField = str | list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt_id: int  # its index among the prompts the run uses
    prompt: PromptField  # the prompt field as the dataset gives it (a built-in's: exactly the text shown)
    answer: Any  # the answer field's value, any JSON; None where the row has no answer field
    where: str  # file:line (Parquet: file:row N) or the built-in's name and index, for errors about it
    row: dict[str, Any] = field(default_factory=dict)  # the row's columns other than prompt and answer
    bucket: str = ""  # the value of ``task.bucket_field``, for skew telemetry


def build_task(config: TaskConfig) -> list[Prompt]:
    """The task's prompts, deterministic from ``config.seed`` (built-ins) or the file's content."""
    if config.name == "jsonl":
        return _dataset_prompts(_jsonl_rows(Path(config.path)), config)
    if config.name == "parquet":
        return _dataset_prompts(_parquet_rows(Path(config.path)), config)
    rng = random.Random(config.seed)
    prompts = []
    for prompt_id in range(config.size):
        length = rng.randint(config.min_digits, config.max_digits)
        text = "".join(rng.choice("0123456789") for _ in range(length))
        answer = text[::-1] if config.name == "reverse" else "".join(sorted(text))
        prompts.append(Prompt(prompt_id, text + PROMPT_END, answer, f"task {config.name} prompt {prompt_id}"))
    return prompts


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            yield where, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError("task.path", f"{where}: not JSON: {exc}") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError("task.path", f"{path}: not a Parquet file: {exc}") from None
    # Rows count from 0, as pyarrow's and pandas' indexes do.
    types = {column.name: column.type for column in table.schema}
    for row_no, record in enumerate(table.to_pylist()):
        where = f"{path}:row {row_no}"
        row = {}
        for column, value in record.items():
            try:
                row[column] = _json_value(value)
            except _NotJson as exc:
                raise ConfigError("task.path", f"{where}: column {column!r} holds {exc.value!r} (Arrow type "
                                               f"{types[column]}), which no reward could receive: rewards get JSON "
                                               "values; cast the column to a string or a number, or drop it") from None
        yield where, row


class _NotJson(Exception):
    def __init__(self, value: object) -> None:
        super().__init__(repr(value))
        self.value = value


def _json_value(value: object) -> object:
    """A Parquet value as JSON has it, so that a sync reward (across a pipe), an async one and an HTTP scorer get
    the same: a decimal as its exact text ("3.10"), bytes as base64 text, a date or time as ISO 8601; lists and
    structs converted within.  Anything else (a duration) raises ``_NotJson``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date | datetime.time):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, list | tuple):  # a map column's pairs are tuples
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    raise _NotJson(value)


def _dataset_prompts(rows: Iterator[tuple[str, object]], config: TaskConfig) -> list[Prompt]:
    prompt_key, answer_key = config.prompt_field, config.answer_field
    prompts: list[Prompt] = []
    for where, record in rows:
        if not isinstance(record, dict):
            raise ConfigError("task.path", f"{where}: a row must be an object of columns, got {type(record).__name__}")
        if prompt_key not in record:
            raise ConfigError("task.prompt_field", f"{where}: no {prompt_key!r} field (the row has {sorted(record)})")
        if answer_key not in record and not config.rewards:
            raise ConfigError("task.answer_field", f"{where}: no {answer_key!r} field (the row has {sorted(record)}); "
                                                   "the default reward, the character match, compares against it")
        row = {key: value for key, value in record.items() if key not in (prompt_key, answer_key)}
        prompts.append(Prompt(len(prompts), _prompt_field(record[prompt_key], prompt_key, where),
                              record.get(answer_key), where, row, _bucket_of(record, config.bucket_field, where)))
    if not prompts:
        raise ConfigError("task.path", f"{config.path} holds no prompts")
    buckets = {p.bucket for p in prompts}
    if len(buckets) > MAX_FIELD_BUCKETS:
        raise ConfigError("task.bucket_field", f"{config.path}: {config.bucket_field!r} has {len(buckets)} distinct "
                                               f"values; skew telemetry keeps counters per value, at most "
                                               f"{MAX_FIELD_BUCKETS}: name a coarser column, or leave it empty to "
                                               "bucket by length")
    return prompts


def _prompt_field(value: object, key: str, where: str) -> PromptField:
    """The prompt field checked: text, or a non-empty list of messages with string roles and contents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return value
    raise ConfigError("task.prompt_field", f"{where}: {key!r} must be a string or a non-empty list of "
                                           f'{{"role", "content"}} messages with string values, got {value!r}')


def _bucket_of(record: dict[str, object], column: str, where: str) -> str:
    """A prompt's bucket: its ``column`` value as text ("" when no column is named)."""
    if not column:
        return ""
    value = record.get(column)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError("task.bucket_field", f"{where}: needs a string or number field {column!r} "
                                               f"(the bucket of each prompt), got {value!r}")
    return str(value)
