"""Saving a bundle: one cut under the exclusive barrier, then an async writer.

The cut (``capture_cut``) is the only place controller state is read for a
checkpoint.  Everything else (policy files, sidecar, training_info, fsync,
rename, ``latest``, retention) happens in ``write_bundle`` while training and
generation go on.  A failure anywhere removes the ``.tmp`` directory and leaves
every finalized bundle untouched.
"""

from __future__ import annotations

import copy
import enum
import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
import torch

from scd import faults
from scd.checkpoint import layout
from scd.dataloader import DataloaderState
from scd.errors import DataPlaneError, InvariantViolation
from scd.replay import GroupMeta, require_exact_inventory

if TYPE_CHECKING:
    from scd.daemon import Controller


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    SKIPPED = "skipped"
    FAILED = "failed"


class Reason(enum.StrEnum):
    """Why an attempt happened (completed) or did not succeed (skipped, failed)."""

    INTERVAL = "interval"
    SIGNAL = "signal"
    SHUTDOWN = "shutdown"
    FINAL = "final"
    NO_PROGRESS = "no_progress"
    ALREADY_RUNNING = "already_running"
    BUNDLE_EXISTS = "bundle_exists"
    IO_ERROR = "io_error"
    DISK_FULL = "disk_full"
    TIMEOUT = "timeout"
    INVARIANT_VIOLATION = "invariant_violation"


TRIGGERS = (Reason.INTERVAL, Reason.SIGNAL, Reason.SHUTDOWN, Reason.FINAL)
SKIP_REASONS = (Reason.NO_PROGRESS, Reason.ALREADY_RUNNING, Reason.BUNDLE_EXISTS)
FAIL_REASONS = (Reason.IO_ERROR, Reason.DISK_FULL, Reason.TIMEOUT, Reason.INVARIANT_VIOLATION)
OUTCOME_REASONS = (
    [(Outcome.COMPLETED, r) for r in TRIGGERS]
    + [(Outcome.SKIPPED, r) for r in SKIP_REASONS]
    + [(Outcome.FAILED, r) for r in FAIL_REASONS]
)


def failure_reason(exc: BaseException) -> Reason:
    if isinstance(exc, InvariantViolation):
        return Reason.INVARIANT_VIOLATION
    if isinstance(exc, DataPlaneError | TimeoutError):
        return Reason.TIMEOUT
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Reason.DISK_FULL
    return Reason.IO_ERROR


@dataclass(slots=True)
class Cut:
    """Controller state at one instant, captured under the exclusive barrier."""

    step: int
    weight_version: int
    epoch: int
    dataloader: DataloaderState
    groups: list[GroupMeta]
    ledger: dict[str, Any]
    sampler_name: str
    sampler_state: dict[str, object]
    supports_replay_checkpoint: bool
    partition: str
    capacity: int
    replay_digest: str
    inventory_count: int
    fingerprint: str
    fingerprint_fields: dict[str, object]
    captured_at: float


@dataclass(slots=True)
class PendingBundle:
    cut: Cut
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tmp: Path
    final: Path
    reason: Reason
    phases: dict[str, float] = field(default_factory=dict)
    started: float = 0.0


async def capture_cut(controller: Controller, tmp: Path, phases: dict[str, float]) -> Cut:
    """One cut: index, ledger, cursor, sampler and trainer counters, and TQ's snapshot, together.

    Under the exclusive barrier no mutation runs, so the TQ snapshot saved into
    ``tmp/data_plane`` and the metadata captured here describe the same rows;
    the exact-inventory check proves it before the barrier is released.
    Records ``barrier_wait``, ``tq_save``, ``tq_list`` (TQ's inventory listing)
    and ``exclusive_hold`` (the hold without the TQ save inside it) into ``phases``.
    """
    faults.hit("before_barrier")
    wait_started = time.monotonic()
    async with controller.barrier.exclusive():
        held_from = time.monotonic()
        faults.hit("in_exclusive_hold")
        phases["barrier_wait"] = held_from - wait_started
        replay = controller.replay
        cut = Cut(
            step=controller.trainer_step, weight_version=controller.weight_version,
            epoch=controller.order.state.epoch,
            dataloader=DataloaderState(**{k: getattr(controller.order.state, k)
                                          for k in DataloaderState.__slots__}),
            groups=replay.groups(), ledger=controller.ledger.to_json(),
            sampler_name=controller.sampler.name, sampler_state=dict(controller.sampler.state()),
            supports_replay_checkpoint=controller.sampler.supports_replay_checkpoint,
            partition=controller.dataplane.partition, capacity=controller.config.async_rl.buffer_capacity_groups,
            replay_digest=replay.digest(), inventory_count=replay.rows,
            fingerprint=controller.config.fingerprint(),
            fingerprint_fields=controller.config.fingerprint_fields(), captured_at=time.time(),
        )
        expected = replay.sample_ids()
        tq_started = time.monotonic()
        await controller.dataplane.save_snapshot(tmp / layout.DATA_PLANE_DIR)
        phases["tq_save"] = time.monotonic() - tq_started
        faults.hit("after_tq_save")
        list_started = time.monotonic()
        listed = await controller.dataplane.list_ids()
        phases["tq_list"] = time.monotonic() - list_started
        require_exact_inventory(expected, listed, "checkpoint")
    phases["exclusive_hold"] = time.monotonic() - held_from - phases["tq_save"]
    return cut


def trainer_state_copy(controller: Controller) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and optimizer state copied to host memory, so training may go on while they are written."""
    trainer = controller.trainer
    return trainer.weights(), copy.deepcopy(trainer.optimizer.state_dict())


def _json(data: object) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)


def sidecar_document(cut: Cut) -> dict[str, object]:
    return {
        "schema_version": layout.SCHEMA_VERSION,
        "partition": cut.partition,
        "replay_digest": cut.replay_digest,
        "groups": [msgspec.to_builtins(g) for g in cut.groups],
        "ledger": cut.ledger,
        "sampler": {"name": cut.sampler_name, "state": cut.sampler_state,
                    "supports_replay_checkpoint": cut.supports_replay_checkpoint},
    }


def _write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)


def write_bundle(pending: PendingBundle, keep_last: int) -> dict[str, int]:
    """Write, fsync and finalize one bundle; then point ``latest`` at it and apply retention.

    Blocking: runs in a worker thread.  Returns byte counts for telemetry.
    """
    tmp, cut = pending.tmp, pending.cut
    sidecar_started = time.monotonic()
    (tmp / layout.POLICY_DIR).mkdir(mode=layout.DIR_MODE, exist_ok=True)
    torch.save(pending.model, tmp / layout.MODEL_FILE)
    torch.save(pending.optimizer, tmp / layout.OPTIMIZER_FILE)
    in_flight = [gid for gid, _, _, state, *_ in cut.ledger["entries"] if state == "in_flight"]
    _write_file(tmp / layout.DATALOADER_FILE, _json({
        "schema_version": layout.SCHEMA_VERSION, "seed": cut.dataloader.seed, "epoch": cut.dataloader.epoch,
        "cursor": cut.dataloader.cursor, "redispatch": in_flight,
    }))
    # Compact: the sidecar grows with the buffer (training_info stays indented for people).
    sidecar = orjson.dumps(sidecar_document(cut), option=orjson.OPT_SORT_KEYS)
    with (tmp / layout.SIDECAR_FILE).open("wb") as f:
        f.write(sidecar[: len(sidecar) // 2])
        f.flush()
        faults.hit("mid_sidecar_write")
        f.write(sidecar[len(sidecar) // 2 :])
    files = layout.bundle_files(tmp)
    data_plane_bytes = layout.dir_bytes(tmp / layout.DATA_PLANE_DIR)
    _write_file(tmp / layout.TRAINING_INFO_FILE, _json({
        "schema_version": layout.SCHEMA_VERSION,
        "step": cut.step, "weight_version": cut.weight_version, "epoch": cut.epoch,
        "sampler": cut.sampler_name, "supports_replay_checkpoint": cut.supports_replay_checkpoint,
        "partition": cut.partition, "replay_digest": cut.replay_digest, "groups": len(cut.groups),
        "samples": cut.inventory_count, "capacity": cut.capacity, "time": cut.captured_at,
        "config_fingerprint": cut.fingerprint, "config_fingerprint_fields": cut.fingerprint_fields,
        "files": files, "sidecar_bytes": len(sidecar), "data_plane_bytes": data_plane_bytes,
    }))
    layout.fsync_tree(tmp)
    pending.phases["sidecar_write"] = time.monotonic() - sidecar_started

    commit_started = time.monotonic()
    marker = tmp / layout.COMMIT_MARKER
    _write_file(marker, layout.sha256_file(tmp / layout.TRAINING_INFO_FILE).encode())
    layout.fsync_path(marker)
    faults.hit("before_finalize_rename")
    os.rename(tmp, pending.final)
    layout.fsync_path(pending.final.parent)
    faults.hit("after_finalize_before_latest")
    layout.write_atomic(pending.final.parent / layout.LATEST, pending.final.name.encode())
    apply_retention(pending.final.parent, keep_last)
    pending.phases["commit"] = time.monotonic() - commit_started
    return {"sidecar_bytes": len(sidecar), "data_plane_bytes": data_plane_bytes}


def apply_retention(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` finalized bundles (never the one ``latest`` names)."""
    bundles = layout.finalized_bundles(root)
    for old in bundles[:-keep_last]:
        # Un-finalize first: a crash mid-delete must not leave a half bundle that looks valid.
        (old / layout.COMMIT_MARKER).unlink()
        layout.fsync_path(old)
        faults.hit("during_retention")
        shutil.rmtree(old)


def discard_tmp(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
