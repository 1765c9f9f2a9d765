"""The backend table: every name has a class and a config sub-table, and the config accepts no other."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from scd.config import GENERATION_BACKENDS, GenerationConfig, parse_config
from scd.errors import ConfigError
from scd.generation import BACKENDS


def test_every_backend_name_has_a_class_and_its_config_sub_table() -> None:
    assert BACKENDS.keys() == GENERATION_BACKENDS.keys()
    sections = {f.name: f.type for f in msgspec.structs.fields(GenerationConfig)}
    assert all(sections[name] is section for name, section in GENERATION_BACKENDS.items())


def test_a_backend_name_outside_the_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"generation\.backend.*'torch', 'vllm', 'synthetic'"):
        parse_config({"generation": {"backend": "tpu"}}, tmp_path)
