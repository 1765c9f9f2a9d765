"""Saving a bundle: one cut under the exclusive barrier, then the writer.

The cut (``capture_cut``) reads the controller state through
``ControllerState.snapshot`` and opens TQ's save window, and nothing more, so
the exclusive hold is milliseconds.  The writer then takes TQ's native snapshot
(``save_data_plane``, proving the cut's inventory) and writes everything else
(policy files, sidecar, training_info, digests, fsync, rename, ``latest``,
retention, in ``write_bundle``) while generation, commits and training go on.  A failure
anywhere removes the ``.tmp`` directory and leaves every finalized bundle
untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from scd import faults
from scd.checkpoint import layout
from scd.dataplane import DataPlane, SaveWindow
from scd.errors import DataPlaneError, InvariantViolation, ShortRead
from scd.replay import require_cut_inventory
from scd.risk import CutMark
from scd.rollouts import RolloutsCut
from scd.schema import (
    CheckpointPhase,
    DataloaderDocument,
    FailReason,
    FinishedSiblingRecord,
    Outcome,
    PrefixRecord,
    SamplerDocument,
    SiblingScoreRecord,
    Sidecar,
    TrainingInfo,
    Trigger,
    encode,
)
from scd.state import ControllerState, Cut
from scd.training.base import StateCapture


def failure_reason(exc: BaseException) -> FailReason:
    if isinstance(exc, InvariantViolation):
        return FailReason.INVARIANT_VIOLATION
    if isinstance(exc, ShortRead):
        return FailReason.SHORT_READ
    if isinstance(exc, DataPlaneError | TimeoutError):
        return FailReason.TIMEOUT
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FailReason.DISK_FULL
    return FailReason.IO_ERROR


@dataclass(frozen=True, slots=True)
class BundleContext:
    """What training_info records about the run beside the cut (from the config, fixed for a run)."""

    partition: str
    storage_units: int
    capacity: int
    group_size: int
    fingerprint: str
    fingerprint_fields: dict[str, Any]
    training_settings: dict[str, Any]


@dataclass(slots=True)
class PendingBundle:
    """A cut and the trainer's state copied at it, on its way to the writer."""

    cut: Cut
    window: SaveWindow
    trainer_state: StateCapture
    at_cut: CutMark  # the work the cut holds, for the loss window once the bundle is final
    rollouts: RolloutsCut  # siblings of the cut's in-flight groups it does not stage
    tmp: Path
    final: Path
    trigger: Trigger
    phases: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    # Set by the writer: the keys TQ's snapshot may hold beyond the cut, and what became of the bundle.
    uncut: list[str] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: Outcome | None = None


async def capture_cut(state: ControllerState, dataplane: DataPlane, phases: dict[str, float]) -> tuple[Cut, SaveWindow]:
    """One cut: the controller state read, and TQ's save window opened, under the exclusive barrier.

    Nothing else happens inside the hold (milliseconds at 10k groups); TQ saves in
    ``save_data_plane``, outside it, while mutations go on.
    """
    faults.hit("before_barrier")
    wait_started = time.monotonic()
    async with state.barrier.exclusive() as hold:
        held_from = time.monotonic()
        await faults.wait_at("in_exclusive_hold")
        phases[CheckpointPhase.BARRIER_WAIT] = held_from - wait_started
        cut = state.snapshot()
        window = dataplane.open_save_window()
    phases[CheckpointPhase.EXCLUSIVE_HOLD] = time.monotonic() - held_from
    phases[CheckpointPhase.MUTATIONS_BLOCKED] = hold.mutations_blocked_s
    return cut, window


async def save_data_plane(pending: PendingBundle, dataplane: DataPlane) -> None:
    """TQ's native snapshot of the cut, taken while commits, consumes and evictions go on.

    Invariant (exact inventory of the cut, at save): right after the save, TQ lists
    every group of the cut, and any other key it lists was put inside the save window.
    With clears deferred for the whole window, every group of the cut was in TQ from
    the cut until after the save, so the snapshot holds it; the keys put inside the
    window are recorded in the bundle for restore to clear.  The window is closed
    (its clears carried out, or left owed if they fail) however the save ends.
    """
    phases, window = pending.phases, pending.window
    try:
        started = time.monotonic()
        await dataplane.save_snapshot(pending.tmp / layout.DATA_PLANE_DIR)
        phases[CheckpointPhase.TQ_SAVE] = time.monotonic() - started
        pending.uncut = sorted(window.uncut)
        faults.hit("after_tq_save")
        started = time.monotonic()
        listed = await dataplane.list_keys()
        phases[CheckpointPhase.TQ_LIST] = time.monotonic() - started
        require_cut_inventory(pending.cut.keys(), listed, window.uncut, "checkpoint")
    finally:
        with anyio.CancelScope(shield=True):
            await dataplane.close_save_window()


def _write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)


def write_bundle(pending: PendingBundle, keep_last: int, context: BundleContext) -> dict[str, int]:
    """Write, fsync and finalize one bundle; then point ``latest`` at it and apply retention.

    Blocking: runs in a worker thread.  Returns byte counts for telemetry.
    """
    tmp, cut, phases = pending.tmp, pending.cut, pending.phases
    clock = time.monotonic()

    def lap(phase: CheckpointPhase) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[phase] = now - clock
        clock = now

    (tmp / layout.POLICY_DIR).mkdir(mode=layout.DIR_MODE, exist_ok=True)
    # Digested as written: the policy's files are most of a bundle's bytes, and reading them back to hash
    # them halved the write's throughput.
    model_digest, optimizer_digest = pending.trainer_state.write(tmp / layout.MODEL_FILE, tmp / layout.OPTIMIZER_FILE)
    lap(CheckpointPhase.POLICY_WRITE)

    dl = cut.dataloader
    _write_file(tmp / layout.DATALOADER_FILE,
                encode(DataloaderDocument(seed=dl.seed, epoch=dl.epoch, cursor=dl.cursor), indent=True))
    # Compact: the sidecar grows with the buffer (training_info stays indented for people).
    sidecar = encode(Sidecar(
        partition=context.partition, replay_digest=cut.replay_digest, groups=cut.groups,
        ledger=cut.ledger.to_document(), uncut_keys=pending.uncut, prompt_fates=cut.fates,
        prefixes=[PrefixRecord(group_id, index, list(p.token_ids), list(p.logprobs), list(p.version_runs))
                  for group_id, prefixes in pending.rollouts.prefixes.items() for index, p in prefixes.items()],
        finished_siblings=[
            FinishedSiblingRecord(group_id, index, c.token_ids, c.logprobs, c.weight_version, c.finish_reason.value)
            for group_id, finished in pending.rollouts.finished.items() for index, c in finished.items()],
        sibling_scores=[
            SiblingScoreRecord(group_id, index, pending.rollouts.weight_version_of(cut.ledger, group_id, index),
                               scored.total, scored.components)
            for group_id, scores in pending.rollouts.scores.items() for index, scored in scores.items()],
        sampler=SamplerDocument(name=cut.sampler_name, state=cut.sampler_state,
                                supports_replay_checkpoint=cut.supports_replay_checkpoint),
    ))
    with (tmp / layout.SIDECAR_FILE).open("wb") as f:
        f.write(sidecar[: len(sidecar) // 2])
        f.flush()
        faults.hit("mid_sidecar_write")
        f.write(sidecar[len(sidecar) // 2 :])
    lap(CheckpointPhase.SIDECAR_WRITE)

    files = layout.bundle_files(tmp, {layout.MODEL_FILE: model_digest, layout.OPTIMIZER_FILE: optimizer_digest,
                                      layout.SIDECAR_FILE: layout.bytes_digest(sidecar)})
    data_plane_bytes = layout.dir_bytes(tmp / layout.DATA_PLANE_DIR)
    lap(CheckpointPhase.HASH)

    _write_file(tmp / layout.TRAINING_INFO_FILE, encode(TrainingInfo(
        step=cut.step, weight_version=cut.weight_version, epoch=dl.epoch, group_size=context.group_size,
        sampler=cut.sampler_name, supports_replay_checkpoint=cut.supports_replay_checkpoint,
        partition=context.partition, replay_digest=cut.replay_digest, groups=len(cut.groups),
        samples=sum(len(g.sample_ids) for g in cut.groups), capacity=context.capacity, time=cut.captured_at,
        config_fingerprint=context.fingerprint, config_fingerprint_fields=context.fingerprint_fields,
        files=files, sidecar_bytes=len(sidecar), data_plane_bytes=data_plane_bytes,
        storage_units=context.storage_units, run=cut.run, trigger=pending.trigger.value,
        evaluated_steps=cut.evaluated_steps, held_evals=cut.held_evals, training_settings=context.training_settings,
    ), indent=True))
    layout.fsync_tree(tmp)
    lap(CheckpointPhase.FSYNC)

    marker = tmp / layout.COMMIT_MARKER
    _write_file(marker, layout.sha256_file(tmp / layout.TRAINING_INFO_FILE).encode())
    layout.fsync_path(marker)
    faults.hit("before_finalize_rename")
    if pending.final.exists():  # this run's own bundle of the step, restored from: recorded again
        layout.replace_bundle(tmp, pending.final)
    else:
        os.rename(tmp, pending.final)
        layout.fsync_path(pending.final.parent)
    faults.hit("after_finalize_before_latest")
    layout.write_atomic(pending.final.parent / layout.LATEST, pending.final.name.encode())
    apply_retention(pending.final.parent, keep_last, pending.final)
    lap(CheckpointPhase.COMMIT)
    return {"sidecar_bytes": len(sidecar), "data_plane_bytes": data_plane_bytes}


def apply_retention(root: Path, keep_last: int, written: Path) -> None:
    """Keep ``written`` (the bundle ``latest`` now names) and the newest ``keep_last - 1`` others.

    After a ``--restore-from`` an older bundle, ``written`` can have a lower step than bundles
    already there; it is never the one deleted.
    """
    others = [b for b in layout.finalized_bundles(root) if b != written]
    for old in others[: max(len(others) - (keep_last - 1), 0)]:
        layout.unfinalize(old)
        faults.hit("during_retention")
        shutil.rmtree(old)


def discard_tmp(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
