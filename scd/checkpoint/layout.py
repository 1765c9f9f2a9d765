"""Where a bundle's files live, and how a directory becomes a finalized bundle.

A bundle is written into ``step_N.tmp/`` and renamed to ``step_N/`` once every
file is on disk and fsynced; the last file written before the rename is the
commit marker.  A directory without the marker, or still named ``*.tmp``, is
never restored.  ``latest`` is a hint only: resolution trusts the directories.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import blake3

POLICY_DIR = "policy"
MODEL_FILE = "policy/model.pt"
OPTIMIZER_FILE = "policy/optimizer.pt"
DATALOADER_FILE = "train_dataloader.json"
TRAINING_INFO_FILE = "training_info.json"
SIDECAR_FILE = "replay_buffer_metadata.json"
DATA_PLANE_DIR = "data_plane"
COMMIT_MARKER = "COMMITTED"
LEGACY_REPLAY_FILE = "replay_buffer.pt"
LATEST = "latest"
# Bundles of a history a ``--discard-newer`` restore left behind, kept in ``abandoned/<time>/``: no
# step directory name matches there, so no restore or retention ever sees them.
ABANDONED_DIR = "abandoned"

_STEP_DIR = re.compile(r"^step_(\d+)$")
DIR_MODE = 0o700


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}.tmp"


def replacing_dir(final: Path) -> Path:
    """Where a finalized bundle waits to take the place of ``final`` (``replace_bundle``)."""
    return final.with_name(final.name + ".replacing")


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def finalized_bundles(root: Path) -> list[Path]:
    """Finalized bundles, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / COMMIT_MARKER).is_file()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def leftover_tmp_dirs(root: Path) -> list[Path]:
    """Directories that are not (or no longer) bundles: ``*.tmp``, and step directories without the
    commit marker (a retention delete that was interrupted un-finalizes first)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        p.name.endswith(".tmp") or (step_of(p) is not None and not (p / COMMIT_MARKER).is_file())))


def unfinalize(bundle: Path) -> None:
    """Remove the commit marker, durably: a crash while the directory is deleted after this must not
    leave a half bundle that looks valid."""
    (bundle / COMMIT_MARKER).unlink()
    fsync_path(bundle)


def replace_bundle(tmp: Path, final: Path) -> None:
    """Put the finalized bundle in ``tmp`` in place of ``final``, a bundle of the same step (the step
    recorded again: an evaluation finished at it after a restore from it).  At every instant one of the
    two is restorable: ``tmp`` becomes ``<final>.replacing`` first (a restore completes it,
    ``finish_replacements``), then ``final`` is un-finalized and removed, then the replacement renamed in."""
    replacing = replacing_dir(final)
    os.rename(tmp, replacing)
    fsync_path(final.parent)
    unfinalize(final)
    shutil.rmtree(final)
    os.rename(replacing, final)
    fsync_path(final.parent)


def finish_replacements(root: Path) -> None:
    """Complete every ``replace_bundle`` a crash interrupted: the replacement is finalized already."""
    if not root.is_dir():
        return
    for replacing in sorted(root.glob("step_*.replacing")):
        final = replacing.with_name(replacing.name.removesuffix(".replacing"))
        if final.exists():
            if (final / COMMIT_MARKER).exists():
                unfinalize(final)
            shutil.rmtree(final)
        os.rename(replacing, final)
        fsync_path(root)


def sha256_file(path: Path) -> str:
    """The commit marker's digest of training_info.json."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """BLAKE3 of a bundle file: ~6x SHA-256 here, and restore hashes every file before TQ loads it."""
    # Large chunks let BLAKE3 hash on every core; TQ's snapshot is one file per storage unit.
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    """``file_digest`` of a file holding ``data``."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def bundle_files(bundle: Path, known: dict[str, str]) -> dict[str, str]:
    """BLAKE3 of every file in the bundle except training_info and the marker, by relative path: hashed
    here unless ``known`` has it (digested while written, ``scd.model.weights.save_digested``)."""
    skip = {TRAINING_INFO_FILE, COMMIT_MARKER}
    names = [str(p.relative_to(bundle)) for p in sorted(bundle.rglob("*")) if p.is_file()]
    return {name: known[name] if name in known else file_digest(bundle / name) for name in names if name not in skip}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (TQ writes without fsync)."""
    for p in sorted(root.rglob("*"), reverse=True):
        fsync_path(p)
    fsync_path(root)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: write a sibling, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
