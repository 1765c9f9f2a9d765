"""Checkpoint attempts: skip or take, hand to the one writer, count outcomes, bound retries.

The checkpointer works on the controller's parts (its state, the data plane,
the trainer), never on the controller.  One long-lived ``run_writer`` task
takes bundles from a stream with no buffer, so one write at a time holds by
construction: an attempt while the writer is busy is skipped
(``already_running``).  Every attempt is recorded once with what really
happened: scheduled (the writer has it), completed, skipped or failed.  An
invariant violation stops the run at once; I/O errors and timeouts are
retried at the next opportunity until ``max_consecutive_failures`` in a row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from scd.barrier import MutationKind
from scd.checkpoint import layout
from scd.checkpoint.interval import CheckpointInterval, cost_of
from scd.checkpoint.save import (
    BundleContext,
    PendingBundle,
    capture_cut,
    discard_tmp,
    failure_reason,
    save_data_plane,
    write_bundle,
)
from scd.config import Config
from scd.dataplane import DataPlane
from scd.errors import InvariantViolation, ScdError
from scd.generation.base import GenerationBackend
from scd.risk import WorkAtRisk
from scd.rollouts import Rollouts, RolloutsCut
from scd.schema import OUTCOME_REASONS, CheckpointPhase, Outcome, SkipReason, Trigger
from scd.state import ControllerState
from scd.telemetry import metrics
from scd.telemetry.eval_reports import report_evals
from scd.telemetry.events import Checkpoint, EventLog
from scd.training.base import Trainer

log = logging.getLogger(__name__)


class CheckpointFailed(ScdError):
    """Checkpointing gave up: too many failures in a row, or the last checkpoint before exit failed."""


@dataclass(frozen=True, slots=True)
class CheckpointerStatistics:
    completed: int
    skipped: int
    failed: int
    consecutive_failures: int
    last_completed_step: int | None
    writing: bool


class Checkpointer:
    def __init__(self, config: Config, events: EventLog, state: ControllerState, dataplane: DataPlane,
                 trainer: Trainer, risk: WorkAtRisk, rollouts: Rollouts, generation: GenerationBackend) -> None:
        ckpt = config.checkpointing
        self.root = Path(ckpt.dir)
        self.export_dir = Path(config.run.export_dir) if config.run.export_dir else None
        self.keep_last = ckpt.keep_last
        self.max_consecutive_failures = ckpt.max_consecutive_failures
        self.events = events
        self.last_completed_step: int | None = None
        # The held-out evaluations the last bundle records: one finished since at its step is progress.
        self._last_completed_evaluations = 0
        self.consecutive_failures = 0
        self._state, self._dataplane, self._trainer, self._risk = state, dataplane, trainer, risk
        self._rollouts, self._generation, self._capture_rollouts = rollouts, generation, ckpt.capture_prefixes
        self._context = BundleContext(
            partition=config.data_plane.partition, storage_units=config.data_plane.storage_units,
            capacity=config.admission_capacity_groups(),
            group_size=config.generation.group_size, fingerprint=config.fingerprint(),
            fingerprint_fields=config.fingerprint_fields(), training_settings=config.training_settings(),
        )
        self._counts = {outcome: 0 for outcome in Outcome}
        self._last_success_wall: float | None = None
        self._to_writer, self._writer_in = anyio.create_memory_object_stream[PendingBundle](0)
        self._idle = anyio.Event()
        self._idle.set()
        self.interval = CheckpointInterval(ckpt, lambda: state.run, state.run_seconds)
        self.interval.seconds()
        for outcome, reason in OUTCOME_REASONS:
            metrics.checkpoint_attempts.labels(outcome.value, reason)
        for phase in CheckpointPhase:
            metrics.checkpoint_phase.labels(phase.value)
        for kind in MutationKind:
            metrics.checkpoint_blocked_mutations.labels(kind.value)

    def statistics(self) -> CheckpointerStatistics:
        return CheckpointerStatistics(
            completed=self._counts[Outcome.COMPLETED], skipped=self._counts[Outcome.SKIPPED],
            failed=self._counts[Outcome.FAILED], consecutive_failures=self.consecutive_failures,
            last_completed_step=self.last_completed_step, writing=not self._idle.is_set(),
        )

    def restored_from(self, step: int, bundle_time: float) -> None:
        """The run continues from a bundle: it is the last success, in step and in time."""
        self.last_completed_step = step
        self._last_completed_evaluations = len(self._state.evaluated_steps)
        self._last_success_wall = bundle_time
        self._risk.restored(bundle_time)

    def newest_good_bundle(self) -> str:
        bundles = layout.finalized_bundles(self.root)
        return str(bundles[-1]) if bundles else f"none in {self.root}"

    async def _record(self, outcome: Outcome, reason: str, step: int, **fields: object) -> None:
        self._counts[outcome] += 1
        if outcome is not Outcome.SCHEDULED:
            metrics.checkpoint_attempts.labels(outcome.value, reason).inc()
        since = time.time() - self._last_success_wall if self._last_success_wall is not None else None
        if since is not None:
            metrics.checkpoint_seconds_since_success.set(since)
        await self.events.emit(Checkpoint(step=step, outcome=outcome.value, reason=reason,
                                          since_last_success_s=since, **fields))

    async def attempt_last(self, trigger: Trigger) -> None:
        """The checkpoint before the process exits (``attempt`` waiting for its write).  At the run's last
        step (``Trigger.FINAL``) with ``run.export_dir``, its bundle is then exported there, replacing an
        earlier export only once the new one is whole."""
        await self.attempt(trigger, wait=True)
        if trigger is Trigger.FINAL and self.export_dir is not None:
            from scd.checkpoint.export import export_bundle

            bundle, out_dir = layout.step_dir(self.root, self._state.trainer_step), self.export_dir
            await anyio.to_thread.run_sync(lambda: export_bundle(bundle, out_dir, replace=True))

    async def attempt(self, trigger: Trigger, *, wait: bool = False) -> Outcome:
        """Take a checkpoint at this train-step boundary, or record why not.

        The cut and the copy of the trainer's state happen here, while the train pump
        waits; the writer saves TQ and writes, while everything else goes on.  With
        ``wait`` (the checkpoint before exit) this returns the write's own outcome,
        waiting for a write in progress first; otherwise SCHEDULED once the writer
        has the bundle.
        """
        step = self._state.trainer_step
        if wait:
            await self._idle.wait()
        elif not self._idle.is_set():
            await self._record(Outcome.SKIPPED, SkipReason.ALREADY_RUNNING, step, trigger=trigger.value)
            return Outcome.SKIPPED
        # An evaluation finished at the last bundle's step (re-run after a drain cut it short there) is
        # progress: a bundle must record it, and this run's own bundle of the step is replaced by one that does.
        evaluated = len(self._state.evaluated_steps) != self._last_completed_evaluations
        if step == self.last_completed_step and not evaluated:
            await self._record(Outcome.SKIPPED, SkipReason.NO_PROGRESS, step, trigger=trigger.value)
            return Outcome.SKIPPED
        final = layout.step_dir(self.root, step)
        if final.exists() and step != self.last_completed_step:
            log.error("checkpoint %s exists already (restored from an older bundle?): not overwriting it", final)
            await self._record(Outcome.SKIPPED, SkipReason.BUNDLE_EXISTS, step, trigger=trigger.value)
            return Outcome.SKIPPED

        tmp = layout.tmp_dir(self.root, step)
        started = time.monotonic()
        phases: dict[str, float] = {}
        try:
            discard_tmp(tmp)
            self.root.mkdir(mode=layout.DIR_MODE, parents=True, exist_ok=True)
            tmp.mkdir(mode=layout.DIR_MODE)
            cut, window = await capture_cut(self._state, self._dataplane, phases)
            # After the hold: a prefix is valid to resume from whenever it is taken (tokens only grow),
            # and the train pump, waiting here, starts no weight version past the cut's meanwhile.
            captured_from = time.monotonic()
            rollouts = (self._rollouts.capture(cut.ledger, self._generation.partial_siblings())
                        if self._capture_rollouts else RolloutsCut())
            phases[CheckpointPhase.PREFIX_CAPTURE] = time.monotonic() - captured_from
            at_cut = self._risk.mark_cut(rollouts)
        except Exception as exc:
            await self._failed(tmp, trigger, exc, step)
            return Outcome.FAILED
        except BaseException:
            discard_tmp(tmp)
            raise
        try:
            copy_started = time.monotonic()
            # Off the loop: a large model's copy to host takes seconds, and /metrics, the watchdog and the
            # pumps go on meanwhile (the train pump waits here, so nothing changes the state being copied).
            trainer_state = await anyio.to_thread.run_sync(self._trainer.capture_state)
            phases[CheckpointPhase.STATE_COPY] = time.monotonic() - copy_started
            phases[CheckpointPhase.TRAIN_PUMP_BLOCKED] = copy_started - started
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._dataplane.close_save_window()
            if not isinstance(exc, Exception):
                discard_tmp(tmp)
                raise
            await self._failed(tmp, trigger, exc, step)
            return Outcome.FAILED
        pending = PendingBundle(cut, window, trainer_state, at_cut, rollouts, tmp, final, trigger, phases, started)
        self._idle = anyio.Event()
        await self._to_writer.send(pending)
        await self._record(Outcome.SCHEDULED, trigger.value, step)
        if not wait:
            return Outcome.SCHEDULED
        await pending.done.wait()
        assert pending.outcome is not None
        return pending.outcome

    async def run_writer(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The one task that writes bundles, one at a time, in the order they were cut."""
        task_status.started()
        # The stream outlives any one run (a controller may run several times); it is never closed.
        while True:
            pending = await self._writer_in.receive()
            try:
                # A failure that ends the run (invariant violation, too many in a row, the last
                # checkpoint before exit) propagates from here and stops the daemon's task group.
                pending.outcome = await self._write_and_record(pending)
            except BaseException:
                pending.outcome = Outcome.FAILED
                raise
            finally:
                # Written or not (a failed data-plane save never reaches the policy write): the capture's host
                # buffers go back for the next capture.
                pending.trainer_state.release()
                self._idle.set()
                pending.done.set()

    async def _write_and_record(self, pending: PendingBundle) -> Outcome:
        step = pending.cut.step
        try:
            await save_data_plane(pending, self._dataplane)
            sizes = await anyio.to_thread.run_sync(write_bundle, pending, self.keep_last, self._context)
        except Exception as exc:
            await self._failed(pending.tmp, pending.trigger, exc, step)
            return Outcome.FAILED
        except BaseException:
            discard_tmp(pending.tmp)
            raise
        now = time.time()
        pending.phases[CheckpointPhase.TOTAL] = time.monotonic() - pending.started
        for phase, seconds in pending.phases.items():
            metrics.checkpoint_phase.labels(phase).observe(seconds)
        metrics.last_checkpoint_timestamp.set(now)
        metrics.checkpoint_sidecar_bytes.set(sizes["sidecar_bytes"])
        metrics.checkpoint_data_plane_bytes.set(sizes["data_plane_bytes"])
        if self._last_success_wall is not None:
            metrics.checkpoint_effective_cadence.set(now - self._last_success_wall)
        self.last_completed_step = step
        self._last_completed_evaluations = len(pending.cut.evaluated_steps)
        self.consecutive_failures = 0
        self.interval.observe(pending.phases)
        self._risk.finalized(pending.at_cut)
        log.info("checkpoint %s (%s): total %.3fs, tq_save %.3fs, exclusive hold %.1f ms, %d groups",
                 pending.final.name, pending.trigger.value, pending.phases[CheckpointPhase.TOTAL],
                 pending.phases[CheckpointPhase.TQ_SAVE], 1000 * pending.phases[CheckpointPhase.EXCLUSIVE_HOLD],
                 len(pending.cut.groups))
        await self._record(Outcome.COMPLETED, pending.trigger.value, step, bundle=str(pending.final),
                           phases=pending.phases, groups=len(pending.cut.groups), cost_s=cost_of(pending.phases),
                           interval_s=self.interval.seconds(), **sizes)
        self._last_success_wall = now
        # The bundle holds the evaluations the cut held: reported now, once (a crash before this line
        # leaves them to the restore from it).
        await report_evals(pending.cut.held_evals, self.events)
        self._state.evals_reported([record["step"] for record in pending.cut.held_evals])
        return Outcome.COMPLETED

    async def _failed(self, tmp: Path, trigger: Trigger, exc: Exception, step: int) -> None:
        discard_tmp(tmp)
        reason = failure_reason(exc)
        await self._record(Outcome.FAILED, reason.value, step, trigger=trigger.value, error=str(exc))
        if isinstance(exc, InvariantViolation):
            raise exc
        self.consecutive_failures += 1
        log.error("checkpoint at step %d failed (%s, %d in a row): %s", step, reason.value,
                  self.consecutive_failures, exc)
        if trigger in (Trigger.SHUTDOWN, Trigger.FINAL):
            raise CheckpointFailed(
                f"the {trigger.value} checkpoint at step {step} failed ({reason.value}: {exc}); "
                f"the newest good bundle is {self.newest_good_bundle()}") from exc
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise CheckpointFailed(
                f"{self.consecutive_failures} consecutive checkpoint failures (last: {reason.value}: {exc}); "
                f"the newest good bundle is untouched: {self.newest_good_bundle()}"
            ) from exc
