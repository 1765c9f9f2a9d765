"""Checkpoint bundles edited the way a disk, an operator or a bug would, on a copy of a test's golden bundles."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from scd.checkpoint import layout


def copy_bundles(golden: dict[str, Any], tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(golden["root"], root)
    return root


def reseal(bundle: Path) -> None:
    """Re-sign a bundle after an edit, as a consistent-but-wrong bundle would be."""
    info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
    info["files"] = layout.bundle_files(bundle, {})
    (bundle / layout.TRAINING_INFO_FILE).write_bytes(orjson.dumps(info))
    (bundle / layout.COMMIT_MARKER).write_text(layout.sha256_file(bundle / layout.TRAINING_INFO_FILE))


def edit_json(bundle: Path, name: str, change: Callable[[dict[str, Any]], None], seal: bool = True) -> None:
    path = bundle / name
    data = orjson.loads(path.read_bytes())
    change(data)
    path.write_bytes(orjson.dumps(data))
    if seal:
        reseal(bundle)


def part_way_siblings(bundle: Path) -> list[Any]:
    """The bundle's part-way siblings as its sidecar lists them (finished siblings are listed apart), so
    that a test can wait for a bundle a restore resumes something from."""
    return orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())["prefixes"]
