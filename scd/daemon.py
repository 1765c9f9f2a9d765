"""The controller and its one task group: where scd's concurrency lives.

Tasks (each named for what it does):

* ``rollout_pump``    admits prompts (capacity, sampler gate) and hands them to generation
* ``generation_pump`` batches admitted prompts into backend calls; finished groups go to the
  committer, aborted ones back to generation for their missing siblings only
* ``scoring``         (``Rollouts.scorer``, ``scd.scoring``) scores each sibling as it finishes, with the
  configured rewards; waits out a reward service's outage
* ``committer``       (``Rollouts.committer``) stages siblings that finish before their group, and
  commits finished groups once scored whole; generation never waits for either
* ``train_pump``      (the host task) selects groups, trains, syncs weights; at step boundaries takes due
  checkpoints and held-out evaluations (``scd.evaluation``)
* ``checkpoint_scheduler`` turns the interval and SIGUSR1 into a checkpoint due at the next step
  boundary; ``checkpoint_writer`` writes bundles, one at a time
* ``drain``           on shutdown, puts the drain deadline on the train pump's cancel scope
* ``http``, ``watchdog``, ``loop_probe``, ``stall_watch``, ``telemetry`` (``scd.watch``), ``goodput``
  (``scd.goodput``): observation

The controller wires parts together: the state a checkpoint captures and every mutation of it live in
``scd.state``, a group's life from admission to commit in ``scd.rollouts``, restore in ``scd.checkpoint.restore``,
observation in ``scd.watch``.  Shutdown is one event passed in (``scd.triggers.Triggers.shutdown``; tests need no
real signals): the rollout pump stops admitting, the train pump stops at its next step boundary or at the drain
deadline, then the last checkpoint is written and must succeed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from scd import faults, systemd
from scd.barrier import CheckpointBarrier, MutationKind
from scd.checkpoint.checkpointer import Checkpointer
from scd.checkpoint.restore import RestoreParts, RestoreReport, restore_state
from scd.cluster import Cluster
from scd.config import Config
from scd.dataplane import DataPlane
from scd.evaluation import Evaluation, eval_prompts
from scd.generation import open_backend
from scd.generation.base import GenerationBackend, GroupRequest
from scd.generation.tokens import TokenCounter
from scd.goodput import GoodputMeter
from scd.model.policy import Policy, build_policy
from scd.model.prompts import RenderedPrompt, render_task
from scd.records import Rollout
from scd.replay import GroupMeta, rollouts_of
from scd.rewards import Scorer, load_rewards
from scd.rollouts import Rollouts
from scd.samplers import build_sampler
from scd.schema import RestorePhase, Trigger
from scd.state import ControllerState
from scd.telemetry import metrics
from scd.telemetry.tracker_hub import event_log
from scd.training.base import Trainer
from scd.training.group import open_trainer
from scd.triggers import Triggers
from scd.watch import CompletionSampler, Watch

log = logging.getLogger(__name__)

DRAIN_DEADLINE_S = 30.0


def _observe_blocked_mutation(kind: MutationKind, waited_s: float) -> None:
    metrics.checkpoint_blocked_mutations.labels(kind.value).inc()
    metrics.checkpoint_mutation_wait.observe(waited_s)


class Controller:
    def __init__(self, config: Config, dataplane: DataPlane, backend: GenerationBackend, policy: Policy,
                 prompts: list[RenderedPrompt], trainer: Trainer, scorer: Scorer,
                 held_out: list[RenderedPrompt]) -> None:
        self.config = config
        self.dataplane = dataplane
        self.backend = backend
        self.policy = policy
        self.trainer = trainer
        self.state = ControllerState(len(prompts), config.task.seed, build_sampler(config), dataplane,
                                     CheckpointBarrier(on_blocked=_observe_blocked_mutation))
        self.rollouts = Rollouts(config, self.state, policy, prompts, scorer, self._notify)
        self.tokens = TokenCounter()  # what the generation pump receives
        self.goodput = GoodputMeter(config, self.rollouts, backend, self.tokens)
        self.events = event_log(config.telemetry, Path(config.run.output_dir), lambda: self.state.run)
        self.checkpointer = (Checkpointer(config, self.events, self.state, dataplane, self.trainer, self.goodput.risk,
                                          self.rollouts, backend)
                             if config.checkpointing.enabled else None)
        self.watch = Watch(config, self.state, self.rollouts, self.goodput, self.tokens, trainer, dataplane,
                           self.events, self.checkpointer, lambda: self.ready, self.rollouts.scoring,
                           CompletionSampler(prompts, policy.decode, config.telemetry.sample_rows))
        self.evaluation = Evaluation(config, held_out, backend, scorer, policy) if held_out else None
        self.metrics_port: int | None = None
        self.ready = False
        self._shutdown = anyio.Event()
        self._changed = anyio.Event()
        self._checkpoint_due: Trigger | None = None
        self._last_read_s = 0.0  # how long the last train step waited for its rows from TQ
        for phase in RestorePhase:
            metrics.restore_phase.labels(phase.value)

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Config, backend: GenerationBackend | None = None,
                   config_dir: Path | None = None) -> AsyncIterator[Controller]:
        """The rewards, Ray + TQ, the generation backend, the trainer; torn down in reverse order.

        A ``backend`` passed in (an engine shared across runs) must serve ``config.model``; it stays open for its
        owner.  A reward's module is imported from ``config_dir`` (the config file's directory; the working
        directory when none is given) first."""
        torch.set_num_threads(config.trainer.torch_threads)
        Path(config.run.output_dir).mkdir(parents=True, exist_ok=True)
        Path(config.telemetry.events_path).parent.mkdir(parents=True, exist_ok=True)
        scorer = load_rewards(config.task, config_dir or Path.cwd())
        policy = build_policy(config.model, config.run.seed)
        task = await anyio.to_thread.run_sync(render_task, config, policy)
        held_out = await anyio.to_thread.run_sync(eval_prompts, config, policy) if config.eval.path else []
        metrics.prompts_dropped.labels("overlong").inc(task.dropped_overlong)
        async with (contextlib.aclosing(scorer), Cluster.open(config) as cluster,
                    DataPlane.open(config.data_plane) as dataplane):
            if config.checkpointing.enabled:
                await cluster.require_shared_directory(Path(config.checkpointing.dir), "checkpointing.dir",
                                                       dataplane.placement.storage_units)
            owned = backend is None
            serving = await open_backend(config, policy) if backend is None else backend
            try:
                async with open_trainer(config, policy) as trainer:
                    controller = cls(config, dataplane, serving, policy, task.prompts, trainer, scorer, held_out)
                    async with controller.events:  # closing it waits (bounded, off the loop) for the trackers
                        await serving.update_weights(controller.trainer.live_weights(),
                                                     controller.state.weight_version)
                        yield controller
            finally:
                if owned:
                    with anyio.CancelScope(shield=True):
                        await serving.aclose()

    async def restore(self, restore_from: Path | None = None, allow_config_change: bool = False,
                      discard_newer: bool = False) -> RestoreReport | None:
        """Restore the newest finalized bundle (or ``restore_from``) before any pump runs."""
        if self.checkpointer is None and restore_from is None:
            return None
        parts = RestoreParts(self.state, self.dataplane, self.trainer, self.backend, self.rollouts, self.events)
        report = await restore_state(self.config, parts, restore_from, allow_config_change, discard_newer)
        if report is not None:
            if self.checkpointer is not None:
                self.checkpointer.restored_from(report.step, report.bundle_time)
            self.watch.publish_gauges()
        return report

    def _notify(self) -> None:
        """Wake every task waiting for capacity or ready groups."""
        self._changed.set()
        self._changed = anyio.Event()

    # ---- pumps -------------------------------------------------------------------------------

    async def wait_for_capacity(self) -> None:
        while not self.rollouts.has_capacity() and not self._shutdown.is_set():
            await self._changed.wait()

    async def rollout_pump(self, to_generation: MemoryObjectSendStream[GroupRequest]) -> None:
        async with to_generation:
            for request in await self.rollouts.take_requeued():
                await to_generation.send(request)
            while True:
                await self.wait_for_capacity()
                if self._shutdown.is_set():
                    return
                await faults.wait_at("before_dispatch")
                await to_generation.send(await self.rollouts.admit())

    async def generation_pump(self, requests: MemoryObjectReceiveStream[GroupRequest]) -> None:
        rollouts = self.rollouts
        limiter = anyio.CapacityLimiter(self.backend.max_concurrent_batches)
        on_sibling = self.tokens.counting(rollouts.on_sibling)

        async def run_batch(batch: list[GroupRequest]) -> None:
            async with limiter:
                started = time.time()
                for req in batch:
                    metrics.group_admission_latency.observe(started - req.admitted_at)
                results = await self.backend.generate(batch, on_sibling)
            for result in results:
                self.tokens.result(result)
                if not rollouts.gather(result) and not self._shutdown.is_set():
                    tg.start_soon(run_batch, [await rollouts.redispatch_aborted(result)], name="generate_batch")

        async with requests, anyio.create_task_group() as tg:
            async for first in requests:
                batch = [first]
                while len(batch) < self.backend.batch_groups:
                    try:
                        batch.append(requests.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                # Hold the batch until a backend slot frees, so later prompts can join the next one.
                await limiter.acquire()
                limiter.release()
                tg.start_soon(run_batch, batch, name="generate_batch")

    async def select_batch(self) -> list[GroupMeta]:
        """Evict stale groups, then the sampler's next step if one is ready now, else []."""
        await self.rollouts.evict_stale()
        state = self.state
        return state.sampler.select(state.replay.groups(), state.weight_version, state.trainer_step)

    async def wait_for_batch(self) -> list[GroupMeta]:
        """Wait until the sampler hands out a full step (or shutdown, or a checkpoint falls due)."""
        while not self._shutdown.is_set() and self._checkpoint_due is None:
            batch = await self.select_batch()
            if batch:
                return batch
            with self.goodput.trainer_starved():
                await self._changed.wait()
        return []

    async def read_batch(self, batch: list[GroupMeta]) -> list[list[Rollout]]:
        read_started = time.monotonic()
        stored = await self.dataplane.get_groups([g.group_id for g in batch])
        self._last_read_s = time.monotonic() - read_started
        return [rollouts_of(group, [ids for ids, _ in rows], [lp for _, lp in rows])
                for group, rows in zip(batch, stored, strict=True)]

    async def train_step(self, batch: list[GroupMeta], groups: list[list[Rollout]]) -> None:
        # Applied whole or not at all: a drain deadline must not leave trained weights behind an unadvanced step.
        with anyio.CancelScope(shield=True):
            await self._apply_step(batch, groups)

    async def _apply_step(self, batch: list[GroupMeta], groups: list[list[Rollout]]) -> None:
        state = self.state
        result = await anyio.to_thread.run_sync(self.trainer.step, groups, state.weight_version)
        staleness = state.weight_version - min(g.start_weight_version for g in batch)
        await state.finish_step(batch)
        sync_started = time.monotonic()
        await self.backend.update_weights(self.trainer.live_weights(), state.weight_version)
        weight_sync_s = time.monotonic() - sync_started  # the backend observes it, labelled by its path
        await self.backend.abort_older_than(state.window_start())
        self._notify()
        await self.watch.step_done(batch, groups, result, staleness, weight_sync_s, self._last_read_s)

    async def train_pump(self, max_steps: int) -> None:
        """Train until ``max_steps`` or shutdown; always returns at a step boundary.

        A due checkpoint is taken at the boundary where the pump finds it, so the
        policy files describe exactly the step the cut describes.
        """
        await self.evaluate_if_due(max_steps)
        while self.state.trainer_step < max_steps and not self._shutdown.is_set():
            if self._checkpoint_due is not None and self.checkpointer is not None:
                trigger, self._checkpoint_due = self._checkpoint_due, None
                # The next step's rows are read before the cut: TQ's save, which a read would
                # queue behind (a storage unit serves one request at a time), then runs while
                # that step trains.  Its groups are ready in the cut and consumed after it.
                batch = await self.select_batch()
                groups = await self.read_batch(batch) if batch else []
                await self.checkpointer.attempt(trigger)
            else:
                batch = await self.wait_for_batch()
                groups = await self.read_batch(batch) if batch else []
            if batch:
                await self.train_step(batch, groups)
                await self.evaluate_if_due(max_steps)

    async def evaluate_if_due(self, last_step: int) -> None:
        """This boundary's held-out evaluation if one is due; a checkpoint falls due after it, which records it."""
        evaluated = self.evaluation is not None and await self.evaluation.at_boundary(
            self.state, last_step, self.goodput, self.events, checkpointed=self.checkpointer is not None)
        if evaluated and self.checkpointer is not None:
            self._checkpoint_due = self._checkpoint_due or Trigger.EVAL

    async def checkpoint_scheduler(self, triggers: Triggers) -> None:
        """Every ``interval_s``, or at once on request: a checkpoint falls due at the next step boundary."""
        while True:
            with anyio.move_on_after(self.checkpointer.interval.seconds()) as timer:
                await triggers.checkpoint_now.wait()
            triggers.checkpoint_now = anyio.Event()
            if self._checkpoint_due is None:
                self._checkpoint_due = Trigger.INTERVAL if timer.cancelled_caught else Trigger.SIGNAL
            self._notify()

    async def last_checkpoint(self, trigger: Trigger, scoring_deadline_s: float) -> None:
        """The checkpoint before the process exits (exported at the last step), written before this returns, once
        scoring has stopped (no reward paid after its cut; waited for what is left of a drain's deadline).  Its
        failure is the run's: ``CheckpointFailed`` (exit 1) names the cause and the newest good bundle."""
        if self.checkpointer is None:
            return
        await self.rollouts.stop_scoring(scoring_deadline_s)
        with anyio.CancelScope(shield=True):
            await self.checkpointer.attempt_last(trigger)

    # ---- the task group ----------------------------------------------------------------------

    async def run(self, triggers: Triggers | None = None, max_steps: int | None = None,
                  drain_deadline_s: float = DRAIN_DEADLINE_S) -> None:
        """Run every pump until ``max_steps`` trainer steps are done or shutdown is triggered."""
        triggers = triggers or Triggers()
        self._shutdown = triggers.shutdown
        max_steps = max_steps if max_steps is not None else self.config.run.max_steps
        telemetry = self.config.telemetry
        to_generation, generation_in = anyio.create_memory_object_stream[GroupRequest](
            self.config.generation.max_inflight_prompts)
        async with anyio.create_task_group() as tg:
            await tg.start(self.rollouts.scorer, name="scoring")
            await tg.start(self.rollouts.committer, name="committer")
            await tg.start(self.goodput.run, name="goodput")
            if self.checkpointer is not None:  # awaited first: READY=1 is systemd's first word, not WATCHDOG=1
                await tg.start(self.checkpointer.run_writer, name="checkpoint_writer")
                tg.start_soon(self.checkpoint_scheduler, triggers, name="checkpoint_scheduler")
            tg.start_soon(self.rollout_pump, to_generation, name="rollout_pump")
            tg.start_soon(self.generation_pump, generation_in, name="generation_pump")
            tg.start_soon(systemd.feed_watchdog, name="watchdog")
            tg.start_soon(self.watch.loop_probe, name="loop_probe")
            tg.start_soon(self.watch.stall_watch, name="stall_watch")
            if telemetry.telemetry_interval_s > 0:
                tg.start_soon(self.watch.telemetry_sampler, telemetry.telemetry_interval_s, name="telemetry")
            train_scope = anyio.CancelScope()
            tg.start_soon(self.drain, train_scope, drain_deadline_s, name="drain")
            systemd.notify("READY=1")
            self.watch.run_started()
            self.ready = True
            self.watch.publish_gauges()
            with train_scope:
                await self.train_pump(max_steps)
            self.stop_serving()
            await self.last_checkpoint(Trigger.SHUTDOWN if self._shutdown.is_set() else Trigger.FINAL,
                                       min(drain_deadline_s, train_scope.deadline - anyio.current_time()))
            tg.cancel_scope.cancel()

    async def drain(self, train_scope: anyio.CancelScope, deadline_s: float) -> None:
        """On shutdown: wake every waiting pump, and give the train pump ``deadline_s`` to reach a boundary."""
        await self._shutdown.wait()
        self.stop_serving()
        log.info("shutdown requested: draining (deadline %.0fs)", deadline_s)
        train_scope.deadline = anyio.current_time() + deadline_s
        self._notify()

    def stop_serving(self) -> None:
        """Not ready any more, and systemd told STOPPING=1 once: at a drain's start, or when training ends."""
        if self.ready:
            self.ready = False
            systemd.notify("STOPPING=1")
