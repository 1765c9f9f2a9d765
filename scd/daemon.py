"""The controller and its one task group: where scd's concurrency lives.

Tasks (each named for what it does):

* ``rollout_pump``   admits prompts (capacity, sampler gate) and hands them to generation
* ``generation_pump`` batches admitted prompts into backend calls; finished groups go to the committer
* ``committer``      puts a group's rows into TQ and records it in the replay index
* ``train_pump``     (the host task) selects groups, trains, syncs weights, consumes
* ``http``           /metrics and /healthz
* ``watchdog``       WATCHDOG=1 to systemd while the loop is responsive
* ``loop_probe``     measures event-loop stalls
* ``checkpoint_scheduler`` turns the interval and SIGUSR1 into a checkpoint due at the next
  step boundary; the train pump takes it there, and ``checkpoint_writer`` tasks write it

Shutdown and checkpoint requests are triggers passed in (tests need no real
signals).  On shutdown the rollout pump stops admitting and the train pump
stops at its next step boundary; if that takes longer than the drain deadline,
the train pump's cancel scope is cancelled.  Then a final checkpoint is written.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from scd import systemd
from scd.barrier import CheckpointBarrier, MutationKind
from scd.checkpoint.checkpointer import Checkpointer
from scd.checkpoint.restore import restore_controller
from scd.checkpoint.save import Reason
from scd.config import Config
from scd.dataloader import DataloaderState, PromptOrder
from scd.dataplane import ROW_FIELDS, DataPlane
from scd.errors import InvariantViolation
from scd.generation import open_backend
from scd.generation.base import GenerationBackend, GroupRequest, GroupResult
from scd.ledger import DropReason, PromptLedger, PromptState
from scd.records import Rollout
from scd.replay import GroupMeta, ReplayIndex, rollouts_of, sample_ids_for
from scd.samplers import Sampler, build_sampler
from scd.tasks import Prompt, build_task, score
from scd.telemetry import metrics
from scd.telemetry.events import EventLog
from scd.telemetry.http import serve_http
from scd.training.grpo import GRPOTrainer
from scd.training.policy import Policy, build_policy

log = logging.getLogger(__name__)

DRAIN_DEADLINE_S = 30.0


@dataclass(slots=True)
class Triggers:
    """What the outside world can ask of a running controller (signals in production, tests directly)."""

    shutdown: anyio.Event = field(default_factory=anyio.Event)
    checkpoint_now: anyio.Event = field(default_factory=anyio.Event)

    def request_checkpoint(self) -> None:
        """Several requests before the scheduler takes one coalesce into one checkpoint."""
        self.checkpoint_now.set()


@dataclass(slots=True)
class ControllerStatistics:
    trainer_step: int
    weight_version: int
    epoch: int
    replay_groups: int
    replay_rows: int
    in_flight: int
    committed_groups: int
    evicted_stale: int
    ledger: dict[str, int]


def _observe_blocked_mutation(kind: MutationKind, waited_s: float) -> None:
    metrics.checkpoint_blocked_mutations.labels(kind.value).inc()
    metrics.checkpoint_mutation_wait.observe(waited_s)


class Controller:
    def __init__(self, config: Config, dataplane: DataPlane, backend: GenerationBackend, policy: Policy,
                 prompts: list[Prompt]) -> None:
        self.config = config
        self.dataplane = dataplane
        self.backend = backend
        self.policy = policy
        self.prompts = prompts
        # Token ids and completion budget per prompt, encoded once.
        self._encoded = [
            (tuple(policy.encode_prompt(p.text)),
             min(len(policy.encode_answer(p.answer)), config.generation.max_new_tokens))
            for p in prompts
        ]
        self.trainer = GRPOTrainer(config, policy)
        self.sampler: Sampler = build_sampler(config)
        self.ledger = PromptLedger()
        self.replay = ReplayIndex()
        self.order = PromptOrder(len(self.prompts), DataloaderState(seed=config.task.seed))
        self.barrier = CheckpointBarrier(on_blocked=_observe_blocked_mutation)
        self.events = EventLog(Path(config.telemetry.events_path))
        self.checkpointer = Checkpointer(config.checkpointing, self.events) if config.checkpointing.enabled else None
        self.trainer_step = 0
        self.weight_version = 0
        self.committed_groups = 0
        self.committed_tokens = 0  # completion tokens of committed groups
        self.evicted_stale = 0
        self.metrics_port: int | None = None
        self._in_flight = 0
        self._draining = False
        self._changed = anyio.Event()
        self._generated_tokens_seen = 0
        self._checkpoint_due: Reason | None = None
        self._last_step_mark = (time.monotonic(), 0, 0, 0)
        for phase in ("resolve", "dataloader", "tq", "replay_metadata", "ledger", "total"):
            metrics.restore_phase.labels(phase)
        self._writer_group: anyio.abc.TaskGroup | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Config, backend: GenerationBackend | None = None) -> AsyncIterator[Controller]:
        """Ray + TQ, the generation backend, the trainer; torn down in reverse order.

        A ``backend`` passed in (an engine shared across runs) must serve ``config.model``;
        it stays open for its owner.
        """
        torch.set_num_threads(config.trainer.torch_threads)
        Path(config.run.output_dir).mkdir(parents=True, exist_ok=True)
        Path(config.telemetry.events_path).parent.mkdir(parents=True, exist_ok=True)
        policy = build_policy(config.model, config.run.seed)
        prompts = build_task(config.task)
        for prompt in prompts:
            policy.check_text(prompt.text + prompt.answer, f"prompt {prompt.prompt_id}")
        async with DataPlane.open(config.data_plane) as dataplane:
            owned = backend is None
            serving = await open_backend(config, policy) if backend is None else backend
            try:
                controller = cls(config, dataplane, serving, policy, prompts)
                await serving.update_weights(controller.trainer.weights(), controller.weight_version)
                yield controller
            finally:
                if owned:
                    with anyio.CancelScope(shield=True):
                        await serving.aclose()

    async def restore(self, restore_from: Path | None = None, allow_config_change: bool = False) -> None:
        """Restore the newest finalized bundle (or ``restore_from``) before any pump runs."""
        if self.checkpointer is None and restore_from is None:
            return
        report = await restore_controller(self, restore_from, allow_config_change)
        if report is None:
            return
        if self.checkpointer is not None:
            self.checkpointer.last_completed_step = report.step
        for phase, seconds in report.phases.items():
            metrics.restore_phase.labels(phase).observe(seconds)
        metrics.recovery_groups_restored.set(report.groups_restored)
        metrics.recovery_groups_evicted_stale.set(report.groups_evicted_stale)
        metrics.recovery_prompts_redispatched.set(report.prompts_redispatched)
        self._publish_gauges()
        log.info("restored %s: step %d, %d groups ready, %d evicted stale, %d prompts to redispatch%s (%.2fs)",
                 report.bundle, report.step, report.groups_restored, report.groups_evicted_stale,
                 report.prompts_redispatched, " [shadow: replay index not restored]" if report.shadow else "",
                 report.phases["total"])
        await self.events.emit(
            "restore", report.step, bundle=str(report.bundle), phases=report.phases,
            groups_restored=report.groups_restored, groups_evicted_stale=report.groups_evicted_stale,
            prompts_redispatched=report.prompts_redispatched, shadow=report.shadow,
        )

    # ---- observation -------------------------------------------------------------------------

    def statistics(self) -> ControllerStatistics:
        return ControllerStatistics(
            trainer_step=self.trainer_step, weight_version=self.weight_version,
            epoch=self.order.state.epoch, replay_groups=len(self.replay), replay_rows=self.replay.rows,
            in_flight=self._in_flight, committed_groups=self.committed_groups,
            evicted_stale=self.evicted_stale, ledger=self.ledger.counts(),
        )

    def _notify(self) -> None:
        """Wake every task waiting for capacity or ready groups."""
        self._changed.set()
        self._changed = anyio.Event()

    def _publish_gauges(self) -> None:
        metrics.trainer_step.set(self.trainer_step)
        metrics.weight_version.set(self.weight_version)
        metrics.replay_groups.set(len(self.replay))
        metrics.replay_rows.set(self.replay.rows)
        for state, n in self.ledger.counts().items():
            metrics.ledger_prompts.labels(state).set(n)
        tokens = self.backend.generated_tokens()
        metrics.generation_tokens.inc(tokens - self._generated_tokens_seen)
        self._generated_tokens_seen = tokens

    # ---- mutations: each one holds the checkpoint barrier shared ---------------------------------

    async def admit(self) -> GroupRequest:
        """Advance the dataloader cursor and record the prompt in flight, as one mutation."""
        async with self.barrier.mutation(MutationKind.ADMIT):
            epoch, prompt_id = self.order.take()
            target_step = self.sampler.on_dispatch()
            group_id = self.ledger.admit(epoch, prompt_id, target_step)
            self._in_flight += 1
        return self._request(group_id)

    def _request(self, group_id: str) -> GroupRequest:
        entry = self.ledger.entry(group_id)
        prompt_ids, max_tokens = self._encoded[entry.prompt_id]
        return GroupRequest(group_id, entry.epoch, entry.prompt_id, prompt_ids,
                            self.config.generation.group_size, max_tokens, entry.target_step, time.time())

    async def redispatch_in_flight(self) -> list[GroupRequest]:
        """Requests for every prompt the ledger holds in flight (admitted, never committed).

        A run that stopped (or a process that died) mid-generation left them there;
        they go to generation again before any new prompt, so none is lost.
        """
        async with self.barrier.mutation(MutationKind.REDISPATCH):
            pending = self.ledger.in_state(PromptState.IN_FLIGHT)
            self._in_flight = len(pending)
            return [self._request(group_id) for group_id in pending]

    async def redispatch_aborted(self, result: GroupResult) -> GroupRequest:
        """A group generation gave back incomplete goes to generation again; the ledger keeps why."""
        reason = result.incomplete_reason()
        async with self.barrier.mutation(MutationKind.REDISPATCH):
            self.ledger.note_redispatch(result.request.group_id, reason)
        metrics.groups_redispatched.inc()
        log.info("group %s back to generation: %s", result.request.group_id, reason)
        return self._request(result.request.group_id)

    def _scored(self, result: GroupResult) -> list[Rollout]:
        """The task scores each sibling's decoded text: the one place a completion is judged."""
        req = result.request
        answer = self.prompts[req.prompt_id].answer
        return [
            Rollout(
                input_ids=torch.tensor([*req.prompt_ids, *c.token_ids], dtype=torch.int64),
                logprobs=torch.tensor(c.logprobs, dtype=torch.float32), prompt_len=len(req.prompt_ids),
                reward=score(self.policy.decode(c.token_ids), answer), weight_version=c.weight_version,
            )
            for c in result.completions
        ]

    async def commit(self, result: GroupResult) -> None:
        """Put a finished group's rows into TQ and index it; validates before it writes.

        If the put fails the rows it may have written are cleared again (keys are
        deterministic, so this is exact) and the error propagates.
        """
        req = result.request
        incomplete = result.incomplete_reason()
        if incomplete:
            raise InvariantViolation(f"commit of incomplete group {req.group_id}: {incomplete}")
        rollouts = self._scored(result)
        sample_ids = sample_ids_for(req.group_id, len(rollouts))
        seq_lens = tuple(r.input_ids.shape[0] for r in rollouts)
        async with self.barrier.mutation(MutationKind.COMMIT):
            state = self.ledger.state_of(req.group_id)
            if state is not PromptState.IN_FLIGHT:
                raise InvariantViolation(f"commit of group {req.group_id} whose ledger state is {state}")
            try:
                await self.dataplane.put_rows(sample_ids, rollouts)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.dataplane.clear(sample_ids)
                raise
            group = GroupMeta(
                group_id=req.group_id, epoch=req.epoch, prompt_id=req.prompt_id,
                sample_ids=sample_ids, start_weight_version=result.start_weight_version,
                end_weight_version=result.end_weight_version, prompt_len=len(req.prompt_ids),
                seq_lens=seq_lens, fields=ROW_FIELDS,
                rewards=tuple(r.reward for r in rollouts),
                weight_versions=tuple(r.weight_version for r in rollouts), target_step=req.target_step,
                admitted_at=req.admitted_at, committed_at=time.time(),
            )
            self.replay.add(group)
            self.ledger.advance(req.group_id, PromptState.READY)
            self._in_flight -= 1
        completion_tokens = group.tokens - group.prompt_len * len(seq_lens)
        self.committed_groups += 1
        self.committed_tokens += completion_tokens
        metrics.committed_groups.inc()
        metrics.committed_tokens.inc(completion_tokens)
        metrics.group_completion_latency.observe(group.committed_at - req.admitted_at)
        self._notify()

    async def _remove_groups(self, kind: MutationKind, groups: Sequence[GroupMeta], state: PromptState,
                             reason: str = "") -> None:
        """Take groups out of the index, clear their TQ rows, and move their prompts to ``state``."""
        async with self.barrier.mutation(kind):
            for group in groups:
                if group.group_id not in self.replay:
                    raise InvariantViolation(f"{kind} of group {group.group_id} that is not in the replay index")
            await self.dataplane.clear([sid for g in groups for sid in g.sample_ids])
            for group in groups:
                self.replay.remove(group.group_id)
                self.ledger.advance(group.group_id, state, reason)
                if kind is MutationKind.EVICT:
                    self.sampler.on_evicted(group)
        self._notify()

    async def consume(self, groups: Sequence[GroupMeta]) -> None:
        await self._remove_groups(MutationKind.CONSUME, groups, PromptState.CONSUMED)

    async def evict_stale(self) -> int:
        stale = [g for g in self.replay.groups() if self.sampler.is_stale(g, self.weight_version)]
        if stale:
            await self._remove_groups(MutationKind.EVICT, stale, PromptState.DROPPED, DropReason.STALE)
            self.evicted_stale += len(stale)
            metrics.groups_evicted_stale.inc(len(stale))
        return len(stale)

    # ---- pumps -------------------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        return (
            self._in_flight < self.config.generation.max_inflight_prompts
            and self._in_flight + len(self.replay) < self.config.async_rl.buffer_capacity_groups
            and self.sampler.may_dispatch(self.trainer_step)
        )

    async def wait_for_capacity(self) -> None:
        while not self._has_capacity() and not self._draining:
            await self._changed.wait()

    async def rollout_pump(self, to_generation: MemoryObjectSendStream[GroupRequest]) -> None:
        async with to_generation:
            for request in await self.redispatch_in_flight():
                await to_generation.send(request)
            while True:
                await self.wait_for_capacity()
                if self._draining:
                    return
                await to_generation.send(await self.admit())

    async def generation_pump(
        self, requests: MemoryObjectReceiveStream[GroupRequest], to_commit: MemoryObjectSendStream[GroupResult]
    ) -> None:
        limiter = anyio.CapacityLimiter(self.backend.max_concurrent_batches)

        async def run_batch(batch: list[GroupRequest]) -> None:
            async with limiter:
                started = time.time()
                for req in batch:
                    metrics.group_admission_latency.observe(started - req.admitted_at)
                results = await self.backend.generate(batch)
            for result in results:
                if not result.incomplete_reason():
                    await to_commit.send(result)
                elif not self._draining:
                    tg.start_soon(run_batch, [await self.redispatch_aborted(result)], name="generate_batch")

        async with requests, to_commit, anyio.create_task_group() as tg:
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

    async def committer(self, results: MemoryObjectReceiveStream[GroupResult]) -> None:
        async with results:
            async for result in results:
                await self.commit(result)

    async def wait_for_batch(self, stop: anyio.Event) -> list[GroupMeta]:
        """Evict stale groups, then wait until the sampler hands out a full step (or ``stop``)."""
        while not stop.is_set() and self._checkpoint_due is None:
            await self.evict_stale()
            batch = self.sampler.select(self.replay.groups(), self.weight_version, self.trainer_step)
            if batch:
                return batch
            await self._changed.wait()
        return []

    async def train_step(self, batch: list[GroupMeta]) -> None:
        data = await self.dataplane.get_rows([sid for g in batch for sid in g.sample_ids])
        input_ids, logprobs = data["input_ids"].unbind(), data["logprobs"].unbind()
        groups, at = [], 0
        for group in batch:
            n = len(group.sample_ids)
            groups.append(rollouts_of(group, input_ids[at:at + n], logprobs[at:at + n]))
            at += n
        # From here the step is applied whole or not at all: a drain deadline must not leave
        # trained weights behind an unadvanced step counter.
        with anyio.CancelScope(shield=True):
            await self._apply_step(batch, groups)

    async def _apply_step(self, batch: list[GroupMeta], groups: list[list[Rollout]]) -> None:
        result = await anyio.to_thread.run_sync(self.trainer.step, groups, self.weight_version)
        staleness = self.weight_version - min(g.start_weight_version for g in batch)
        self.trainer_step += 1
        self.weight_version += 1
        sync_started = time.monotonic()
        await self.backend.update_weights(self.trainer.weights(), self.weight_version)
        weight_sync_s = time.monotonic() - sync_started
        metrics.weight_sync.observe(weight_sync_s)
        await self.backend.abort_older_than(self.weight_version - self.sampler.max_staleness_versions)
        await self.consume(batch)
        self.ledger.prune_finished_epochs(self.order.state.epoch)
        metrics.train_reward_mean.set(result.reward_mean)
        metrics.train_staleness.set(staleness)
        if result.logprob_mismatch_mean is not None:
            metrics.train_logprob_mismatch.labels("mean").set(result.logprob_mismatch_mean)
            metrics.train_logprob_mismatch.labels("max").set(result.logprob_mismatch_max)
        self._publish_gauges()
        log.info("step %d version %d reward %.3f loss %.4f committed %d staleness %d replay %d",
                 self.trainer_step, self.weight_version, result.reward_mean, result.loss,
                 self.committed_groups, staleness, len(self.replay))
        now, groups, committed = time.monotonic(), self.committed_groups, self.committed_tokens
        tokens = self.backend.generated_tokens()
        last_at, last_groups, last_committed, last_tokens = self._last_step_mark
        self._last_step_mark = (now, groups, committed, tokens)
        elapsed = max(now - last_at, 1e-9)
        await self.events.emit(
            "train_step", self.trainer_step, epoch=self.order.state.epoch, weight_version=self.weight_version,
            reward_mean=result.reward_mean, loss=result.loss, staleness=staleness,
            prompt_ids=[[g.epoch, g.prompt_id] for g in batch],
            logprob_mismatch_mean=result.logprob_mismatch_mean, logprob_mismatch_max=result.logprob_mismatch_max,
            logprob_mismatch_tokens=result.logprob_mismatch_tokens, weight_sync_ms=weight_sync_s * 1e3,
            committed_groups_per_s=(groups - last_groups) / elapsed,
            generated_tokens_per_s=(tokens - last_tokens) / elapsed,
            committed_tokens_per_s=(committed - last_committed) / elapsed,
        )

    async def train_pump(self, max_steps: int, stop: anyio.Event) -> None:
        """Train until ``max_steps`` or ``stop``; always returns at a step boundary.

        A due checkpoint is taken at the boundary where the pump finds it, so the
        policy files describe exactly the step the cut describes.
        """
        while self.trainer_step < max_steps and not stop.is_set():
            if self._checkpoint_due is not None and self.checkpointer is not None:
                reason, self._checkpoint_due = self._checkpoint_due, None
                await self.checkpointer.attempt(self, reason, self._writer_group)
            batch = await self.wait_for_batch(stop)
            if batch:
                await self.train_step(batch)

    async def checkpoint_scheduler(self, triggers: Triggers) -> None:
        """Every ``interval_s``, or at once on request: a checkpoint falls due at the next step boundary."""
        assert self.checkpointer is not None
        while True:
            with anyio.move_on_after(self.config.checkpointing.interval_s) as timer:
                await triggers.checkpoint_now.wait()
            triggers.checkpoint_now = anyio.Event()
            if self._checkpoint_due is None:
                self._checkpoint_due = Reason.INTERVAL if timer.cancelled_caught else Reason.SIGNAL
            self._notify()

    async def final_checkpoint(self, reason: Reason) -> None:
        """Wait for a background writer, then checkpoint inline before the process exits."""
        if self.checkpointer is None:
            return
        with anyio.CancelScope(shield=True):
            await self.checkpointer.wait_idle()
            await self.checkpointer.attempt(self, reason, writer_group=None)

    # ---- the task group ----------------------------------------------------------------------

    async def run(self, triggers: Triggers | None = None, max_steps: int | None = None,
                  drain_deadline_s: float = DRAIN_DEADLINE_S) -> None:
        """Run every pump until ``max_steps`` trainer steps are done or shutdown is triggered."""
        triggers = triggers or Triggers()
        max_steps = max_steps if max_steps is not None else self.config.run.max_steps
        telemetry = self.config.telemetry
        stop = anyio.Event()
        to_generation, generation_in = anyio.create_memory_object_stream[GroupRequest](
            self.config.generation.max_inflight_prompts)
        to_commit, commit_in = anyio.create_memory_object_stream[GroupResult](math.inf)
        async with anyio.create_task_group() as tg:
            self._writer_group = tg
            self.metrics_port = await tg.start(
                serve_http, telemetry.metrics_host, telemetry.metrics_port, lambda: True, name="http")
            tg.start_soon(self.rollout_pump, to_generation, name="rollout_pump")
            tg.start_soon(self.generation_pump, generation_in, to_commit, name="generation_pump")
            tg.start_soon(self.committer, commit_in, name="committer")
            tg.start_soon(systemd.feed_watchdog, name="watchdog")
            tg.start_soon(self.loop_probe, name="loop_probe")
            if self.checkpointer is not None:
                tg.start_soon(self.checkpoint_scheduler, triggers, name="checkpoint_scheduler")
            if telemetry.telemetry_interval_s > 0:
                tg.start_soon(self.telemetry_sampler, telemetry.telemetry_interval_s, name="telemetry")
            train_scope = anyio.CancelScope()
            tg.start_soon(self.drain_on, triggers.shutdown, stop, train_scope, drain_deadline_s, name="drain")
            systemd.notify("READY=1")
            self._publish_gauges()
            with train_scope:
                await self.train_pump(max_steps, stop)
            systemd.notify("STOPPING=1")
            await self.final_checkpoint(Reason.SHUTDOWN if stop.is_set() else Reason.FINAL)
            tg.cancel_scope.cancel()
        self._writer_group = None

    async def drain_on(self, shutdown: anyio.Event, stop: anyio.Event, train_scope: anyio.CancelScope,
                       deadline_s: float) -> None:
        await shutdown.wait()
        log.info("shutdown requested: draining (deadline %.0fs)", deadline_s)
        systemd.notify("STOPPING=1")
        self._draining = True
        stop.set()
        self._notify()
        await anyio.sleep(deadline_s)
        log.warning("drain deadline passed: stopping the train pump mid-step")
        train_scope.cancel()

    async def telemetry_sampler(self, interval_s: float) -> None:
        """Sample gauges on a wall-clock interval into /metrics and the event log; never touches checkpoints."""
        while True:
            await anyio.sleep(interval_s)
            self._publish_gauges()
            stats = self.statistics()
            await self.events.emit(
                "sample", self.trainer_step, weight_version=stats.weight_version, epoch=stats.epoch,
                replay_groups=stats.replay_groups, replay_rows=stats.replay_rows, in_flight=stats.in_flight,
                committed_groups=stats.committed_groups, generated_tokens=self.backend.generated_tokens(),
                ledger=stats.ledger,
            )

    async def loop_probe(self, period_s: float = 0.05) -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(period_s)
            metrics.loop_stall.observe(max(0.0, time.monotonic() - before - period_s))
