"""Watching the running controller: /healthz's and /readyz's answers, the gauges, the step rates, stalls and the loop.

``Watch`` holds what observation keeps between train steps (the last step's mark, recent step times,
the worst recent loop probe, why training looks stalled) and runs the observers the controller starts
by name: ``telemetry_sampler``, ``stall_watch``, ``loop_probe``.  It reads the controller's parts and
never mutates them.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from scd.checkpoint.checkpointer import Checkpointer
from scd.config import Config
from scd.dataplane import DataPlane
from scd.generation.tokens import TokenCounter, TokenCounterStatistics
from scd.goodput import GoodputMeter
from scd.model.prompts import RenderedPrompt
from scd.records import Rollout
from scd.replay import GroupMeta, mean_reward_components
from scd.rollouts import Rollouts
from scd.scoring import ScoringStage
from scd.state import ControllerState
from scd.telemetry import metrics
from scd.telemetry.events import Completions, EventLog, Sample, SampleRow, Stall, TrainStep
from scd.training.base import StepResult, Trainer

log = logging.getLogger(__name__)

# /healthz calls the loop behind when a probe woke this much late within the last LOOP_STALL_WINDOW_S.
LOOP_BEHIND_S = 1.0
LOOP_STALL_WINDOW_S = 30.0
RECENT_STEPS = 32  # step times the stall limit's median is taken over


class Watch:
    def __init__(self, config: Config, state: ControllerState, rollouts: Rollouts, goodput: GoodputMeter,
                 tokens: TokenCounter, trainer: Trainer, dataplane: DataPlane, events: EventLog,
                 checkpointer: Checkpointer | None, serves: Callable[[], bool], scoring: ScoringStage,
                 sampler: CompletionSampler) -> None:
        self.config = config
        self.state = state
        self.rollouts = rollouts
        self.goodput = goodput
        self.tokens = tokens
        self.trainer = trainer
        self.dataplane = dataplane
        self.events = events
        self.checkpointer = checkpointer
        self.serves = serves  # whether the run serves (ready, not draining): only then can training stall
        self.scoring = scoring
        self.sampler = sampler
        self._last_stall = (0.0, 0.0)  # (monotonic time, seconds late) of the worst recent probe
        self._last_step_mark = (time.monotonic(), 0, 0, 0)  # (time, committed groups, committed tokens, tokens)
        self._last_completions = tokens.statistics()  # the completions counted at the last step
        self._step_times: deque[float] = deque(maxlen=RECENT_STEPS)  # seconds between recent steps
        self._last_progress = time.monotonic()  # the last step's end, or the run's start
        self._stalled = ""  # why training looks stalled, or "" (what /healthz reports)

    def health_problem(self) -> str:
        """Why the process is unhealthy, or "" when it is not."""
        stalled_at, stalled_s = self._last_stall
        if stalled_s >= LOOP_BEHIND_S and time.monotonic() - stalled_at < LOOP_STALL_WINDOW_S:
            return f"event loop fell {stalled_s:.1f}s behind {time.monotonic() - stalled_at:.0f}s ago"
        if self.dataplane.last_call_timed_out:
            return (f"TransferQueue did not answer its last call within "
                    f"data_plane.call_timeout_s = {self.config.data_plane.call_timeout_s}s")
        if self.checkpointer is not None and self.checkpointer.consecutive_failures:
            return f"checkpointing failed {self.checkpointer.consecutive_failures} time(s) in a row"
        return self._stalled

    def outage(self) -> str:
        """What the healthy process waits for, or "" when nothing: a reward's service that does not answer
        (what /readyz reports; /healthz stays ok, for a restart would only wait again, its work lost)."""
        scoring = self.scoring.statistics()
        if not scoring.unavailable:
            return ""
        return (f"scoring has waited {scoring.unavailable_s:.0f}s for a reward ({scoring.scoring} siblings "
                f"waiting): {scoring.unavailable}")

    def publish_gauges(self) -> None:
        state = self.state
        metrics.trainer_step.set(state.trainer_step)
        metrics.weight_version.set(state.weight_version)
        metrics.replay_groups.set(len(state.replay))
        metrics.replay_rows.set(state.replay.rows)
        metrics.staged_siblings.set(state.ledger.staged_count())
        metrics.prompt_fates.follow(state.fates)
        for ledger_state, n in state.ledger.counts().items():
            metrics.ledger_prompts.labels(ledger_state).set(n)

    def run_started(self) -> None:
        """The stall limit counts from here until the first step."""
        self._last_progress = time.monotonic()

    async def step_done(self, batch: list[GroupMeta], groups: list[list[Rollout]], result: StepResult, staleness: int,
                        weight_sync_s: float, read_s: float) -> None:
        """A train step was applied: its gauges, its log line, the rates since the last one, its event; every
        ``telemetry.sample_every_steps``, a few of its completions."""
        state = self.state
        metrics.train_reward_mean.set(result.reward_mean)
        metrics.train_staleness.set(staleness)
        if result.logprob_mismatch_mean is not None:
            metrics.train_logprob_mismatch.labels("mean").set(result.logprob_mismatch_mean)
            metrics.train_logprob_mismatch.labels("max").set(result.logprob_mismatch_max)
        self.publish_gauges()
        log.info("step %d version %d reward %.3f loss %.4f committed %d staleness %d replay %d",
                 state.trainer_step, state.weight_version, result.reward_mean, result.loss,
                 state.committed_groups, staleness, len(state.replay))
        now, groups_done = time.monotonic(), state.committed_groups
        committed = self.rollouts.statistics().committed_tokens
        completions = self.tokens.statistics()
        tokens = completions.generated_tokens
        last_at, last_groups, last_committed, last_tokens = self._last_step_mark
        self._last_step_mark = (now, groups_done, committed, tokens)
        elapsed = max(now - last_at, 1e-9)
        self._step_times.append(now - self._last_progress)
        self._last_progress, self._stalled = now, ""
        await self.events.emit(TrainStep(
            step=state.trainer_step, epoch=state.order.state.epoch, weight_version=state.weight_version,
            **result.event_fields(), staleness=staleness, prompt_ids=[[g.epoch, g.prompt_id] for g in batch],
            weight_sync_ms=weight_sync_s * 1e3, weight_export_ms=self.trainer.statistics().last_export_s * 1e3,
            tq_read_ms=read_s * 1e3, **state.fates.step_fields(),
            committed_groups_per_s=(groups_done - last_groups) / elapsed,
            generated_tokens_per_s=(tokens - last_tokens) / elapsed,
            committed_tokens_per_s=(committed - last_committed) / elapsed,
            **self.goodput.on_train_step(batch).event_fields(), **self._completion_fields(completions),
            reward_components=mean_reward_components(batch),
        ))
        every = self.config.telemetry.sample_every_steps
        if every and state.trainer_step % every == 0:
            rows = await anyio.to_thread.run_sync(self.sampler.rows, batch, groups)
            await self.events.emit(Completions(step=state.trainer_step, rows=rows))

    def _completion_fields(self, now: TokenCounterStatistics) -> dict[str, float | None]:
        """The share truncated and the mean length of the complete completions generated since the last
        step (None when there were none)."""
        last, self._last_completions = self._last_completions, now
        complete = now.complete_completions - last.complete_completions
        if not complete:
            return {"truncation_rate": None, "completion_tokens_mean": None}
        return {"truncation_rate": (now.truncated_completions - last.truncated_completions) / complete,
                "completion_tokens_mean": (now.complete_completion_tokens - last.complete_completion_tokens) / complete}

    async def telemetry_sampler(self, interval_s: float) -> None:
        """Sample gauges on a wall-clock interval into /metrics and the event log; never touches checkpoints."""
        while True:
            await anyio.sleep(interval_s)
            self.publish_gauges()
            stats = self.state.statistics()
            await self.events.emit(Sample(
                step=stats.trainer_step, weight_version=stats.weight_version, epoch=stats.epoch,
                replay_groups=stats.replay_groups, replay_rows=stats.replay_rows, in_flight=stats.in_flight,
                committed_groups=stats.committed_groups, generated_tokens=self.tokens.statistics().generated_tokens,
                ledger=stats.ledger,
            ))

    def stall_limit_s(self) -> float:
        """How long the run may go without a train step before it is called stalled."""
        telemetry = self.config.telemetry
        recent = statistics.median(self._step_times) if self._step_times else 0.0
        return max(telemetry.stall_after_s, telemetry.stall_after_steps * recent)

    async def stall_watch(self, period_s: float = 1.0) -> None:
        """No train step for longer than ``stall_limit_s`` while the run serves and waits out no outage:
        /healthz answers 503 with why, and one ``stall`` event is logged per stall (a step ends it)."""
        while True:
            await anyio.sleep(period_s)
            if self.outage():
                # Waiting out a reward outage is no stall (a liveness probe would restart the wait): the clock
                # starts again when the service answers.
                self._last_progress, self._stalled = time.monotonic(), ""
                continue
            idle_s, limit_s = time.monotonic() - self._last_progress, self.stall_limit_s()
            if not self.serves() or idle_s <= limit_s or self._stalled:
                continue
            state, rollouts = self.state.statistics(), self.rollouts.statistics()
            self._stalled = (f"no train step for {idle_s:.0f}s (limit {limit_s:.0f}s): {state.in_flight} prompts "
                             f"in flight, {rollouts.awaiting_commit} awaiting commit, {state.replay_groups} groups "
                             "ready")
            log.warning("training stalled: %s", self._stalled)
            await self.events.emit(Stall(step=state.trainer_step, idle_s=idle_s, limit_s=limit_s,
                                         in_flight=state.in_flight, awaiting_commit=rollouts.awaiting_commit,
                                         replay_groups=state.replay_groups))

    async def loop_probe(self, period_s: float = 0.05) -> None:
        """How late the loop wakes a periodic sleep: /metrics's histogram, and /healthz's worst recent one."""
        while True:
            before = time.monotonic()
            await anyio.sleep(period_s)
            now = time.monotonic()
            late = max(0.0, now - before - period_s)
            metrics.loop_stall.observe(late)
            if late >= self._last_stall[1] or now - self._last_stall[0] >= LOOP_STALL_WINDOW_S:
                self._last_stall = (now, late)



@dataclass(frozen=True, slots=True)
class CompletionSampler:
    """What a ``completions`` event shows of a train step: the first sibling of each of its first ``count``
    groups, as a person reads it."""

    prompts: Sequence[RenderedPrompt]
    decode: Callable[[Sequence[int]], str]
    count: int

    def rows(self, batch: Sequence[GroupMeta], groups: Sequence[Sequence[Rollout]]) -> list[SampleRow]:
        """Blocking (it decodes): off the loop."""
        sampled = []
        for group, rollouts in zip(batch[:self.count], groups, strict=False):
            first = rollouts[0]
            prompt = self.prompts[group.prompt_id].prompt
            sampled.append(SampleRow(epoch=group.epoch, prompt_id=group.prompt_id, prompt=prompt.prompt,
                                     completion=self.decode(first.input_ids[first.prompt_len:].tolist()),
                                     answer=prompt.answer, reward=first.reward))
        return sampled
