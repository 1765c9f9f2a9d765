"""Goodput: how busy generation is, how busy it can be without waste, and what it throws away.

Three measures, live (Prometheus gauges, every ``train_step`` event, ``scd report``):

* ``scd_engine_busy_ratio{engine}``: time with at least one request in flight over wall time, over
  the last ``telemetry.goodput_window_s`` (a sliding window of samples taken every
  ``SAMPLE_PERIOD_S`` and at every train step);
* ``scd_generation_waste_ratio``: tokens thrown away (groups dropped stale, finished siblings dropped
  out of the window, the partial output of aborted siblings; ``Rollouts`` counts them where it drops
  them) over tokens generated, since the run started;
* ``scd_goodput_ratio``: tokens trained over tokens generated, since the run started.  Groups
  committed before it (a restore's) are not this run's generation: their training is left out.

Dynamic sampling (``async_rl.drop_zero_variance_groups``) is a row of its own: the tokens of complete groups
filtered because their rewards were all equal (``scd_generation_filtered_tokens``) are neither trained nor
waste; they are what a run pays to find the groups that carry signal, and stay in the generated tokens.

And the bound.  The trainer takes R_t groups per second of its own time (all of it but the waits for a
batch: reads, steps, weight syncs, checkpoints); generation makes R_g groups per busy second, summed over
engines.  Within the staleness window generation may run ahead of the trainer only by what the window
holds, so in a steady state it can usefully make only what the trainer takes: an engine busy more than
min(1, R_t / R_g) of the time generates waste.  Held-out evaluation is a row of its own: the seconds the
engines generate it are taken out of the window (engines, trainer and wall clock alike: the trainer waits
for it, the engines serve it) and its tokens out of the generated ones, so neither the ratios nor the
bound count it.  Both rates are estimated over the same sliding window, and ``scd_engine_busy_bound`` is
that minimum; ``scd_trainer_starved_ratio`` (the share of the window the trainer waited for a batch) is
what a steady state falls short of it by: busy x R_g = R_t x (1 - starved).  Paced admission
(``Rollouts.has_capacity``) is what lets generation reach it without waste.  R_g is measured at the
occupancy the engine had when busy: an engine that is faster when fuller than the run keeps it is credited
with less.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from scd.config import Config
from scd.generation.base import BusyClock, EngineActivity, GenerationBackend
from scd.generation.tokens import TokenCounter
from scd.replay import GroupMeta
from scd.risk import WorkAtRisk
from scd.rollouts import Rollouts
from scd.telemetry import metrics

SAMPLE_PERIOD_S = 1.0


@dataclass(frozen=True, slots=True)
class _Sample:
    """Cumulative counts at one instant; a reading compares two."""

    at: float  # monotonic
    engines: dict[str, EngineActivity]
    trained_groups: int
    trained_group_tokens: int  # completion tokens of every trained group (what converts R_g to groups)
    trainer_starved_s: float  # time the trainer waited for a batch
    eval_s: float  # time held-out evaluation ran
    eval_tokens: int  # tokens it generated


def share_of_generated(tokens: int, generated_tokens: int) -> float:
    """The waste and goodput ratios: 0 before anything was generated."""
    return tokens / generated_tokens if generated_tokens else 0.0


@dataclass(frozen=True, slots=True)
class GoodputReading:
    engine_busy_ratio: dict[str, float]  # by engine, over the sliding window
    engine_busy_bound: float | None  # min(1, R_t / R_g); None until both rates have been measured
    trainer_groups_per_s: float | None  # R_t
    generation_groups_per_s: float | None  # R_g
    trainer_starved_ratio: float  # share of the window the trainer waited for a batch: busy falls short of bound by it
    generated_tokens: int  # since the run started
    wasted_tokens: int
    filtered_tokens: int  # of complete groups with no reward variance: not trained, not waste
    trained_tokens: int  # of groups this run committed

    @property
    def waste_ratio(self) -> float:
        return share_of_generated(self.wasted_tokens, self.generated_tokens)

    @property
    def goodput_ratio(self) -> float:
        return share_of_generated(self.trained_tokens, self.generated_tokens)

    def event_fields(self) -> dict[str, object]:
        """The ``train_step`` event's goodput fields (``run_*``: counts since the run started)."""
        return {
            "engine_busy_ratio": self.engine_busy_ratio, "engine_busy_bound": self.engine_busy_bound,
            "trainer_groups_per_s": self.trainer_groups_per_s,
            "generation_groups_per_s": self.generation_groups_per_s,
            "trainer_starved_ratio": self.trainer_starved_ratio,
            "generation_waste_ratio": self.waste_ratio, "goodput_ratio": self.goodput_ratio,
            "run_generated_tokens": self.generated_tokens, "run_wasted_tokens": self.wasted_tokens,
            "run_trained_tokens": self.trained_tokens, "run_filtered_tokens": self.filtered_tokens,
        }


class GoodputMeter:
    """Samples the backend's engines, the rollouts' waste and the trainer's steps; publishes the gauges."""

    def __init__(self, config: Config, rollouts: Rollouts, backend: GenerationBackend, tokens: TokenCounter) -> None:
        self._window_s = config.telemetry.goodput_window_s
        self._rollouts = rollouts
        self._backend = backend
        self._samples: deque[_Sample] = deque()
        self._trained_groups = self._trained_group_tokens = 0
        self._own_trained_tokens = 0  # of groups this run committed: its goodput
        self._trainer_starved = BusyClock()
        self._evaluating = BusyClock()
        self._eval_tokens = 0
        self.risk = WorkAtRisk(rollouts, backend, tokens)
        self._started_wall = time.time()
        self._generated_at_start = self._wasted_at_start = self._filtered_at_start = 0
        # The last estimates, kept while the window holds no train step (R_t) or no busy time (R_g).
        self._trainer_rate: float | None = None
        self._generation_rate: float | None = None
        self._tokens_per_group: float | None = None
        limit = config.async_rl.buffer_capacity_groups
        window = config.window_capacity_groups()
        metrics.buffer_capacity_groups.labels("configured").set(window if limit == "auto" else limit)
        metrics.buffer_capacity_groups.labels("window").set(window)
        metrics.buffer_capacity_groups.labels("admission").set(config.admission_capacity_groups())

    def start(self) -> None:
        """Measure from now: this run's tokens only (a restore's waste is its own event's)."""
        self._started_wall = time.time()
        self._generated_at_start = sum(e.generated_tokens for e in self._backend.engine_activity()) - self._eval_tokens
        rollouts = self._rollouts.statistics()
        self._wasted_at_start, self._filtered_at_start = rollouts.wasted_tokens, rollouts.filtered_tokens
        self._own_trained_tokens = 0
        self._samples.clear()
        self.sample()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start measuring, then sample every ``SAMPLE_PERIOD_S`` until cancelled (gauges stay live
        while no step completes)."""
        self.start()
        task_status.started()
        while True:
            await anyio.sleep(SAMPLE_PERIOD_S)
            self.sample()
            self.risk.publish()

    @contextmanager
    def trainer_starved(self) -> Iterator[None]:
        """Held while the trainer waits for a batch: the rest of its time is its own work."""
        with self._trainer_starved.request():
            yield

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Held while the engines generate a held-out evaluation: that time is booked apart from training's."""
        with self._evaluating.request():
            yield

    def on_eval(self, tokens: int) -> None:
        """An evaluation generated ``tokens``: not training's, not waste."""
        self._eval_tokens += tokens

    def on_train_step(self, batch: Sequence[GroupMeta]) -> GoodputReading:
        """A step trained ``batch``."""
        tokens = sum(group.completion_tokens for group in batch)
        self._trained_groups += len(batch)
        self._trained_group_tokens += tokens
        self._own_trained_tokens += sum(g.completion_tokens for g in batch if g.committed_at >= self._started_wall)
        metrics.trained_tokens.inc(tokens)
        return self.sample()

    def sample(self) -> GoodputReading:
        now = time.monotonic()
        current = _Sample(now, {e.engine: e for e in self._backend.engine_activity()}, self._trained_groups,
                          self._trained_group_tokens, self._trainer_starved.seconds(), self._evaluating.seconds(),
                          self._eval_tokens)
        self._samples.append(current)
        # Keep the newest sample at or before the window's start: the window spans it in full.
        while len(self._samples) > 2 and self._samples[1].at <= now - self._window_s:
            self._samples.popleft()
        reading = self._reading(self._samples[0], current)
        _publish(reading)
        return reading

    def _reading(self, before: _Sample, after: _Sample) -> GoodputReading:
        eval_s = after.eval_s - before.eval_s
        elapsed = after.at - before.at - eval_s
        busy = {name: max(0.0, self._busy_delta(before, engine) - eval_s) for name, engine in after.engines.items()}
        ratios = {name: min(1.0, seconds / elapsed) if elapsed > 0 else 0.0 for name, seconds in busy.items()}
        trained = after.trained_groups - before.trained_groups
        starved = after.trainer_starved_s - before.trainer_starved_s
        trainer_busy = elapsed - starved
        eval_tokens_each = (after.eval_tokens - before.eval_tokens) / max(1, len(after.engines))
        if trained and trainer_busy > 0:
            self._trainer_rate = trained / trainer_busy
            self._tokens_per_group = (after.trained_group_tokens - before.trained_group_tokens) / trained
        tokens_per_busy_s = sum(
            (engine.generated_tokens - before.engines[name].generated_tokens - eval_tokens_each) / busy[name]
            for name, engine in after.engines.items() if name in before.engines and busy[name] > 0)
        if tokens_per_busy_s > 0 and self._tokens_per_group:
            self._generation_rate = tokens_per_busy_s / self._tokens_per_group
        bound = (min(1.0, self._trainer_rate / self._generation_rate)
                 if self._trainer_rate is not None and self._generation_rate else None)
        generated = (sum(e.generated_tokens for e in after.engines.values()) - after.eval_tokens
                     - self._generated_at_start)
        rollouts = self._rollouts.statistics()
        return GoodputReading(
            engine_busy_ratio=ratios, engine_busy_bound=bound, trainer_groups_per_s=self._trainer_rate,
            generation_groups_per_s=self._generation_rate,
            trainer_starved_ratio=min(1.0, starved / elapsed) if elapsed > 0 else 0.0, generated_tokens=generated,
            wasted_tokens=rollouts.wasted_tokens - self._wasted_at_start,
            filtered_tokens=rollouts.filtered_tokens - self._filtered_at_start,
            trained_tokens=self._own_trained_tokens,
        )

    @staticmethod
    def _busy_delta(before: _Sample, engine: EngineActivity) -> float:
        """The engine's busy seconds within the window (all of them if it appeared within it)."""
        earlier = before.engines.get(engine.engine)
        return engine.busy_seconds - (earlier.busy_seconds if earlier is not None else 0.0)


def _publish(reading: GoodputReading) -> None:
    for engine, ratio in reading.engine_busy_ratio.items():
        metrics.engine_busy_ratio.labels(engine).set(ratio)
    if reading.engine_busy_bound is not None:
        metrics.engine_busy_bound.set(reading.engine_busy_bound)
    if reading.trainer_groups_per_s is not None:
        metrics.trainer_groups_per_second.set(reading.trainer_groups_per_s)
    if reading.generation_groups_per_s is not None:
        metrics.generation_groups_per_second.set(reading.generation_groups_per_s)
    metrics.trainer_starved_ratio.set(reading.trainer_starved_ratio)
    metrics.generation_waste_ratio.set(reading.waste_ratio)
    metrics.goodput_ratio.set(reading.goodput_ratio)
