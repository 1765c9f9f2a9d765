"""The data-safety tests' config: configs/tiny.toml checkpointing into a test's directory, on its own partition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import tiny_config

CHECKPOINTING = {"enabled": True, "interval_s": 3600, "keep_last": 2, "max_consecutive_failures": 5}


def config_for(root: Path, partition: str, **sections: dict[str, Any]) -> Any:
    sections["checkpointing"] = {**CHECKPOINTING, "dir": str(root), **sections.get("checkpointing", {})}
    sections["trainer"] = {"groups_per_step": 4, **sections.get("trainer", {})}
    sections["task"] = {"size": 64, **sections.get("task", {})}
    sections["async_rl"] = {"buffer_capacity_groups": 16, **sections.get("async_rl", {})}
    return tiny_config(root.parent, partition, **sections)
