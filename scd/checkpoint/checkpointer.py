"""Checkpoint attempts: skip or take, write in the background, count outcomes, bound retries.

Every attempt ends in exactly one recorded outcome with a reason from
``save.Reason``.  An invariant violation stops the daemon at once; I/O errors
and timeouts are retried at the next opportunity until
``max_consecutive_failures`` in a row, then the daemon stops with exit 1.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from scd.barrier import MutationKind
from scd.checkpoint import layout
from scd.checkpoint.save import (
    OUTCOME_REASONS,
    Outcome,
    PendingBundle,
    Reason,
    capture_cut,
    discard_tmp,
    failure_reason,
    trainer_state_copy,
    write_bundle,
)
from scd.config import CheckpointingConfig
from scd.errors import InvariantViolation, ScdError
from scd.telemetry import metrics
from scd.telemetry.events import EventLog

if TYPE_CHECKING:
    from scd.daemon import Controller

log = logging.getLogger(__name__)
PHASES = ("total", "tq_save", "barrier_wait", "exclusive_hold", "sidecar_write", "commit", "tq_list")


class CheckpointFailed(ScdError):
    """Too many consecutive retryable checkpoint failures."""


@dataclass(slots=True)
class CheckpointerStatistics:
    completed: int
    skipped: int
    failed: int
    consecutive_failures: int
    last_completed_step: int | None
    writing: bool


class Checkpointer:
    def __init__(self, config: CheckpointingConfig, events: EventLog) -> None:
        self.root = Path(config.dir)
        self.keep_last = config.keep_last
        self.max_consecutive_failures = config.max_consecutive_failures
        self.events = events
        self.last_completed_step: int | None = None
        self.consecutive_failures = 0
        self._counts = {outcome: 0 for outcome in Outcome}
        self._last_success_wall: float | None = None
        self._idle = anyio.Event()
        self._idle.set()
        metrics.checkpoint_interval.set(config.interval_s)
        for outcome, reason in OUTCOME_REASONS:
            metrics.checkpoint_attempts.labels(outcome.value, reason.value)
        for phase in PHASES:
            metrics.checkpoint_phase.labels(phase)
        for kind in MutationKind:
            metrics.checkpoint_blocked_mutations.labels(kind.value)

    def statistics(self) -> CheckpointerStatistics:
        return CheckpointerStatistics(
            completed=self._counts[Outcome.COMPLETED], skipped=self._counts[Outcome.SKIPPED],
            failed=self._counts[Outcome.FAILED], consecutive_failures=self.consecutive_failures,
            last_completed_step=self.last_completed_step, writing=not self._idle.is_set(),
        )

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def _record(self, outcome: Outcome, reason: Reason, step: int, **fields: object) -> None:
        self._counts[outcome] += 1
        metrics.checkpoint_attempts.labels(outcome.value, reason.value).inc()
        await self.events.emit("checkpoint", step, outcome=outcome.value, reason=reason.value, **fields)

    async def attempt(self, controller: Controller, trigger: Reason, writer_group: TaskGroup | None) -> Outcome:
        """Take a checkpoint at this train-step boundary, or record why not.

        The cut and the copy of the trainer's state happen here, while the train pump
        waits; writing happens in ``writer_group`` (or inline when it is None, for the
        final checkpoint).
        """
        step = controller.trainer_step
        if not self._idle.is_set():
            await self._record(Outcome.SKIPPED, Reason.ALREADY_RUNNING, step, trigger=trigger.value)
            return Outcome.SKIPPED
        if step == self.last_completed_step:
            await self._record(Outcome.SKIPPED, Reason.NO_PROGRESS, step, trigger=trigger.value)
            return Outcome.SKIPPED
        final = layout.step_dir(self.root, step)
        if final.exists():
            log.error("checkpoint %s exists already (restored from an older bundle?): not overwriting it", final)
            await self._record(Outcome.SKIPPED, Reason.BUNDLE_EXISTS, step, trigger=trigger.value)
            return Outcome.SKIPPED

        tmp = layout.tmp_dir(self.root, step)
        started = time.monotonic()
        phases: dict[str, float] = {}
        try:
            discard_tmp(tmp)
            self.root.mkdir(mode=layout.DIR_MODE, parents=True, exist_ok=True)
            tmp.mkdir(mode=layout.DIR_MODE)
            cut = await capture_cut(controller, tmp, phases)
            model, optimizer = trainer_state_copy(controller)
        except Exception as exc:
            await self._failed(tmp, trigger, exc, step)
            return Outcome.FAILED
        except BaseException:
            discard_tmp(tmp)
            raise
        pending = PendingBundle(cut, model, optimizer, tmp, final, trigger, phases, started)
        self._idle = anyio.Event()
        if writer_group is None:
            await self._write(pending)
        else:
            writer_group.start_soon(self._write, pending, name="checkpoint_writer")
        return Outcome.COMPLETED

    async def _write(self, pending: PendingBundle) -> None:
        try:
            await self._write_and_record(pending)
        finally:
            # Idle only once the outcome is recorded: a final checkpoint waits for it.
            self._idle.set()

    async def _write_and_record(self, pending: PendingBundle) -> None:
        step = pending.cut.step
        try:
            sizes = await anyio.to_thread.run_sync(write_bundle, pending, self.keep_last)
        except Exception as exc:
            await self._failed(pending.tmp, pending.reason, exc, step)
            return
        except BaseException:
            discard_tmp(pending.tmp)
            raise
        now = time.time()
        pending.phases["total"] = time.monotonic() - pending.started
        for phase, seconds in pending.phases.items():
            metrics.checkpoint_phase.labels(phase).observe(seconds)
        metrics.last_checkpoint_timestamp.set(now)
        metrics.checkpoint_sidecar_bytes.set(sizes["sidecar_bytes"])
        metrics.checkpoint_data_plane_bytes.set(sizes["data_plane_bytes"])
        if self._last_success_wall is not None:
            metrics.checkpoint_effective_cadence.set(now - self._last_success_wall)
        self._last_success_wall = now
        self.last_completed_step = step
        self.consecutive_failures = 0
        log.info("checkpoint %s (%s): total %.3fs, tq_save %.3fs, exclusive hold %.1f ms, %d groups",
                 pending.final.name, pending.reason.value, pending.phases["total"], pending.phases["tq_save"],
                 1000 * pending.phases["exclusive_hold"], len(pending.cut.groups))
        await self._record(Outcome.COMPLETED, pending.reason, step, bundle=str(pending.final),
                           phases=pending.phases, groups=len(pending.cut.groups), **sizes)

    async def _failed(self, tmp: Path, trigger: Reason, exc: Exception, step: int) -> None:
        discard_tmp(tmp)
        reason = failure_reason(exc)
        await self._record(Outcome.FAILED, reason, step, trigger=trigger.value, error=str(exc))
        if isinstance(exc, InvariantViolation):
            raise exc
        self.consecutive_failures += 1
        log.error("checkpoint at step %d failed (%s, %d in a row): %s", step, reason.value,
                  self.consecutive_failures, exc)
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise CheckpointFailed(
                f"{self.consecutive_failures} consecutive checkpoint failures (last: {reason.value}: {exc}); "
                f"the newest good bundle is untouched in {self.root}"
            ) from exc
