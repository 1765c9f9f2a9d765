"""bench.evaluation measures what users run: the eval overhead with the chat example's checkpointing on."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.evaluation import chat_config
from scd.config import load_config
from tests.conftest import REPO


@pytest.mark.parametrize("evaluate", [False, True])
def test_the_eval_overhead_bench_checkpoints_as_the_chat_example_does(tmp_path: Path, evaluate: bool) -> None:
    example = load_config(REPO / "configs" / "chat-task.toml").checkpointing
    measured = chat_config(tmp_path, tmp_path / "model", evaluate=evaluate).checkpointing
    assert measured.enabled and example.enabled
    assert (measured.interval_s, measured.keep_last, measured.capture_prefixes) == (
        example.interval_s, example.keep_last, example.capture_prefixes)
