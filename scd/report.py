"""Offline report over scd's JSONL event log: PNG plots plus a fixed-width summary table.

Reads the log that ``scd.telemetry.events.EventLog`` appends across restarts, each line decoded as
a struct of what the report reads of its event (logs from before a field existed decode too).
Against the trainer step (a step trained again after a restore: its latest values) it draws what a
person asks first: the reward, smoothed, with its spread (``reward.png``); loss, entropy, completion
length and truncation rate (``learning.png``); the held-out eval reward and pass@k (``eval.png``).
Against wall-clock seconds since the first event: the training throughput, goodput (each engine's
busy ratio against its bound, waste and goodput ratios), each checkpoint phase and each restore
phase, and the skew (trained ÷ admitted prompts per bucket, and their distance); process starts and
restores are dashed vertical lines there, so the cost of a restart shows up where it happened.  A
figure with no data is not written: the summary names it.  The summary ends with sample completions
(the last ``completions`` and ``eval`` events' rows). ``goodput_totals`` sums goodput over every run in a
log (a crash loop's waste). matplotlib is an optional extra (``scd[report]``) and is imported only
when a report is written.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from scd.errors import ScdError
from scd.goodput import share_of_generated
from scd.schema import CheckpointPhase, RestorePhase
from scd.telemetry.events import Checkpoint, Completions, Eval, Restore, Sample, Start, TrainStep, tag_of

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CHECKPOINT_PHASES = tuple(phase.value for phase in CheckpointPhase)
RESTORE_PHASES = tuple(phase.value for phase in RestorePhase)
RATE_FIELDS = ("committed_groups_per_s", "generated_tokens_per_s", "committed_tokens_per_s")
# A train step's goodput ratios, and the counts since its run started that runs are summed from.
GOODPUT_RATIOS = ("engine_busy_bound", "generation_waste_ratio", "goodput_ratio")
GOODPUT_COUNTS = ("run_generated_tokens", "run_wasted_tokens", "run_trained_tokens")
LEARNING_FIELDS = ("loss", "entropy", "completion_tokens_mean", "truncation_rate")
FINAL_REWARD_STEPS = 10
SAMPLE_ROWS = 4  # completions the summary shows, of the last completions event and of the last eval
_STEP_LABEL = "trainer step"
RATE_WINDOW_STEPS = 10  # steps per minute over the last this-many train steps

_OUTCOMES = ("completed", "skipped", "failed")
_OUTCOME_STYLE = {"skipped": ("tab:gray", 0.92), "failed": ("tab:red", 0.97)}  # colour, height in axes
_TIME_LABEL = "wall-clock time since first event (s)"


@dataclass(frozen=True)
class _TrainStep:
    time: float
    step: int
    reward_mean: float
    rates: dict[str, float]
    busy: dict[str, float]  # engine_busy_ratio by engine (empty in logs from before it)
    goodput: dict[str, float]  # the GOODPUT_RATIOS and GOODPUT_COUNTS the step reported
    learning: dict[str, float]  # the LEARNING_FIELDS the step reported


@dataclass(frozen=True)
class _Eval:
    time: float
    step: int
    reward_mean: float
    pass_at_k: dict[str, float]
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class _Checkpoint:
    time: float
    outcome: str
    reason: str
    phases: dict[str, float]


@dataclass(frozen=True)
class _Restore:
    time: float
    step: int  # the bundle's step the process went on from
    phases: dict[str, float]
    stale_groups: int
    stale_tokens: int  # 0 in logs from before restores reported it


@dataclass(frozen=True)
class GoodputTotals:
    """Goodput summed over every run in a log: each run's counts as of its last train step (what a
    run did after it, up to a SIGKILL, is in neither count), plus what each restore threw away."""

    runs: int
    generated_tokens: int
    wasted_tokens: int  # by the runs and by the restores
    trained_tokens: int
    restore_stale_groups: int
    restore_stale_tokens: int

    @property
    def waste_ratio(self) -> float:
        return share_of_generated(self.wasted_tokens, self.generated_tokens)

    @property
    def goodput_ratio(self) -> float:
        return share_of_generated(self.trained_tokens, self.generated_tokens)


@dataclass(frozen=True)
class _Skew:
    """What a train step reported of the skew (``scd.skew``): counts that a restore continues."""

    time: float
    tvd: float
    trained_per_admitted: dict[str, float]  # by bucket


# What the report reads of each event it knows (``scd.telemetry.events``).  A field that logs from before
# it lack defaults to absent; a field present with the wrong type fails the line.
class _StartLine(msgspec.Struct, tag_field="event", tag=tag_of(Start)):
    time: float


class _SampleLine(msgspec.Struct, tag_field="event", tag=tag_of(Sample)):
    time: float


class _RestoreLine(msgspec.Struct, tag_field="event", tag=tag_of(Restore)):
    time: float
    step: int = 0
    phases: dict[str, float] = {}
    groups_evicted_stale: int | None = None
    stale_tokens: int | None = None


class _TrainStepLine(msgspec.Struct, tag_field="event", tag=tag_of(TrainStep)):
    time: float
    step: int
    reward_mean: float
    committed_groups_per_s: float | None = None
    generated_tokens_per_s: float | None = None
    committed_tokens_per_s: float | None = None
    engine_busy_ratio: dict[str, float] | None = None
    engine_busy_bound: float | None = None
    generation_waste_ratio: float | None = None
    goodput_ratio: float | None = None
    run_generated_tokens: float | None = None
    run_wasted_tokens: float | None = None
    run_trained_tokens: float | None = None
    training_skew_tvd: float | None = None
    trained_per_admitted: dict[str, float] | None = None
    loss: float | None = None
    entropy: float | None = None
    completion_tokens_mean: float | None = None
    truncation_rate: float | None = None


class _EvalLine(msgspec.Struct, tag_field="event", tag=tag_of(Eval)):
    time: float
    step: int
    reward_mean: float
    pass_at_k: dict[str, float] = {}
    rows: list[dict[str, Any]] = []


class _CompletionsLine(msgspec.Struct, tag_field="event", tag=tag_of(Completions)):
    time: float
    step: int
    rows: list[dict[str, Any]] = []


class _CheckpointLine(msgspec.Struct, tag_field="event", tag=tag_of(Checkpoint)):
    time: float
    outcome: str
    reason: str
    phases: dict[str, float] = {}


_Line = _StartLine | _SampleLine | _RestoreLine | _TrainStepLine | _CheckpointLine | _EvalLine | _CompletionsLine
_KNOWN_EVENTS = frozenset(tag_of(kind) for kind in (Start, Sample, Restore, TrainStep, Checkpoint, Eval,
                                                    Completions))


def _present(line: _TrainStepLine, names: Sequence[str]) -> dict[str, float]:
    """The fields of ``names`` the line has a value for."""
    values = {name: getattr(line, name) for name in names}
    return {name: float(value) for name, value in values.items() if value is not None}


@dataclass
class _Run:
    """Every recognised event of one log, each series sorted by time; times are absolute."""

    times: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    restores: list[_Restore] = field(default_factory=list)
    train_steps: list[_TrainStep] = field(default_factory=list)
    checkpoints: list[_Checkpoint] = field(default_factory=list)
    skews: list[_Skew] = field(default_factory=list)  # train steps from before skew telemetry have none
    evals: list[_Eval] = field(default_factory=list)
    completions: _CompletionsLine | None = None  # the last completions event

    @property
    def t0(self) -> float:
        return min(self.times)

    @property
    def span(self) -> float:
        return max(self.times) - self.t0

    def since_start(self, times: Sequence[float]) -> list[float]:
        return [t - self.t0 for t in times]

    def add(self, line: _Line) -> None:
        self.times.append(line.time)
        match line:
            case _StartLine():
                self.starts.append(line.time)
            case _RestoreLine():
                self.restores.append(_Restore(line.time, line.step, line.phases, line.groups_evicted_stale or 0,
                                              line.stale_tokens or 0))
            case _TrainStepLine():
                self.train_steps.append(_TrainStep(line.time, line.step, line.reward_mean, _present(line, RATE_FIELDS),
                                                   line.engine_busy_ratio or {},
                                                   _present(line, (*GOODPUT_RATIOS, *GOODPUT_COUNTS)),
                                                   _present(line, LEARNING_FIELDS)))
                if line.training_skew_tvd is not None:
                    self.skews.append(_Skew(line.time, line.training_skew_tvd, line.trained_per_admitted or {}))
            case _CheckpointLine():
                self.checkpoints.append(_Checkpoint(line.time, line.outcome, line.reason, line.phases))
            case _EvalLine():
                self.evals.append(_Eval(line.time, line.step, line.reward_mean, line.pass_at_k, line.rows))
            case _CompletionsLine():
                if self.completions is None or line.time >= self.completions.time:
                    self.completions = line

    def sort(self) -> None:
        by_time = attrgetter("time")
        self.starts.sort()
        self.restores.sort(key=by_time)
        self.train_steps.sort(key=by_time)
        self.checkpoints.sort(key=by_time)
        self.skews.sort(key=by_time)
        self.evals.sort(key=by_time)

    def steps_by_step(self) -> list[_TrainStep]:
        """One train step per step number, in step order: a step trained again after a restore, its latest."""
        return sorted({s.step: s for s in self.train_steps}.values(), key=attrgetter("step"))

    def evals_by_step(self) -> list[_Eval]:
        return sorted({e.step: e for e in self.evals}.values(), key=attrgetter("step"))


def _load(path: Path) -> _Run:
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise ScdError(f"{path}: event log not found") from None
    except OSError as exc:
        raise ScdError(f"{path}: cannot read event log: {exc}") from exc
    run = _Run()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            # A crash mid-write leaves a torn line, and the next process starts a line of its own after it.
            log.warning("%s:%d: not valid JSON (torn by a crash mid-write?), skipped: %s", path, line_no, exc)
            continue
        if not isinstance(record, dict):
            raise ScdError(f"{path}:{line_no}: not a JSON object")
        if record.get("event") not in _KNOWN_EVENTS:
            continue
        try:
            run.add(msgspec.convert(record, _Line))
        except msgspec.ValidationError as exc:
            raise ScdError(f"{path}:{line_no}: malformed {record['event']} event: {exc}") from None
    if not run.times:
        raise ScdError(f"{path}: event log has no scd events (empty file?)")
    run.sort()
    return run


# ---- plots ------------------------------------------------------------------------------------------


def _mark_restarts(ax: Axes, run: _Run) -> None:
    for times, colour, label in ((run.starts, "tab:gray", "process start"),
                                 ([r.time for r in run.restores], "tab:purple", "restore")):
        for i, x in enumerate(run.since_start(times)):
            ax.axvline(x, color=colour, linestyle="--", linewidth=1, alpha=0.8, label=label if i == 0 else None)


def _finish(ax: Axes, run: _Run, title: str, ylabel: str, has_data: bool) -> None:
    """Restart lines, labels, a shared x range, and either a legend or a "no data" note."""
    _mark_restarts(ax, run)
    margin = 0.02 * run.span or 1.0
    ax.set_xlim(-margin, run.span + margin)
    _label(ax, title, ylabel, _TIME_LABEL, has_data)


def _label(ax: Axes, title: str, ylabel: str, xlabel: str, has_data: bool) -> None:
    """Title, axis labels, a grid, and either a legend or a "no data" note: every panel's finish."""
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if not has_data:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="gray")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def smoothed(values: Sequence[float], window: int) -> tuple[list[float], list[float]]:
    """Each value's trailing mean over up to ``window`` values, and their standard deviation (the spread)."""
    means, spreads = [], []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1):i + 1]
        mean = fmean(recent)
        means.append(mean)
        spreads.append(fmean([(v - mean) ** 2 for v in recent]) ** 0.5)
    return means, spreads


def _smoothing_window(points: int) -> int:
    return max(1, min(50, points // 20))


def _finish_by_step(ax: Axes, run: _Run, title: str, ylabel: str, has_data: bool) -> None:
    """A plot against the trainer step: restores at the step they went on from, labels, a legend or "no data"."""
    for i, restore in enumerate(run.restores):
        ax.axvline(restore.step, color="tab:purple", linestyle="--", linewidth=1, alpha=0.8,
                   label="restore" if i == 0 else None)
    _label(ax, title, ylabel, _STEP_LABEL, has_data)


def _plot_reward(fig: Figure, run: _Run) -> None:
    ax = fig.subplots()
    steps = run.steps_by_step()
    x, rewards = [s.step for s in steps], [s.reward_mean for s in steps]
    window = _smoothing_window(len(rewards))
    mean, spread = smoothed(rewards, window)
    ax.plot(x, rewards, ".", markersize=2, color="tab:blue", alpha=0.35, label="reward_mean (each step)")
    ax.plot(x, mean, "-", color="tab:blue", linewidth=2, label=f"mean of the last {window} steps")
    ax.fill_between(x, [m - s for m, s in zip(mean, spread, strict=True)],
                    [m + s for m, s in zip(mean, spread, strict=True)], color="tab:blue", alpha=0.15,
                    label="± their standard deviation")
    _finish_by_step(ax, run, "Training reward", "reward", bool(steps))


def _plot_learning(fig: Figure, run: _Run) -> None:
    """Loss, entropy, completion length and truncation rate against the step, each smoothed as the reward."""
    fig.set_size_inches(11, 7.0)
    steps = run.steps_by_step()
    titles = {"loss": ("Loss", "loss"), "entropy": ("Entropy of the sampled tokens", "nats"),
              "completion_tokens_mean": ("Completion length", "tokens (mean)"),
              "truncation_rate": ("Truncation rate: ended at generation.max_new_tokens", "share")}
    axes = fig.subplots(2, 2, sharex=True)
    for ax, name in zip(axes.flat, LEARNING_FIELDS, strict=True):
        points = [(s.step, s.learning[name]) for s in steps if name in s.learning]
        if points:
            x, values = [p for p, _ in points], [v for _, v in points]
            window = _smoothing_window(len(values))
            ax.plot(x, values, ".", markersize=2, alpha=0.35, color="tab:green")
            ax.plot(x, smoothed(values, window)[0], "-", linewidth=2, color="tab:green",
                    label=f"mean of the last {window}")
        if name == "truncation_rate":
            ax.set_ylim(-0.02, 1.02)
        _finish_by_step(ax, run, titles[name][0], titles[name][1], bool(points))
    for ax in axes[0]:
        ax.set_xlabel("")


def _plot_eval(fig: Figure, run: _Run) -> None:
    """The held-out eval's mean reward and pass@k at each step evaluated."""
    ax = fig.subplots()
    evals = run.evals_by_step()
    x = [e.step for e in evals]
    ax.plot(x, [e.reward_mean for e in evals], "o-", linewidth=2, label="eval reward_mean")
    for k in sorted({k for e in evals for k in e.pass_at_k}, key=int):
        points = [(e.step, e.pass_at_k[k]) for e in evals if k in e.pass_at_k]
        ax.plot([p for p, _ in points], [v for _, v in points], "s--", markersize=4, label=f"pass@{k}")
    rewards = [e.reward_mean for e in evals]
    ax.set_ylim(min(0.0, *rewards) - 0.02, max(1.0, *rewards) + 0.02)
    _finish_by_step(ax, run, "Held-out evaluation", "reward / pass@k", bool(evals))


def _steps_per_minute(steps: Sequence[_TrainStep]) -> tuple[list[float], list[float]]:
    """Train steps per minute over a sliding window of the last ``RATE_WINDOW_STEPS`` steps."""
    times, rates = [], []
    for i in range(1, len(steps)):
        first = max(0, i - RATE_WINDOW_STEPS)
        elapsed = steps[i].time - steps[first].time
        if elapsed > 0:
            times.append(steps[i].time)
            rates.append(60.0 * (i - first) / elapsed)
    return times, rates


def _plot_throughput(fig: Figure, run: _Run) -> None:
    panels = [("train steps", "steps / min", ())]
    if any("generated_tokens_per_s" in s.rates or "committed_tokens_per_s" in s.rates for s in run.train_steps):
        panels.append(("tokens", "tokens / s", ("generated_tokens_per_s", "committed_tokens_per_s")))
    if any("committed_groups_per_s" in s.rates for s in run.train_steps):
        panels.append(("committed groups", "groups / s", ("committed_groups_per_s",)))
    fig.set_size_inches(11, 3.2 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ylabel, names) in zip(axes, panels, strict=True):
        if names:
            for name in names:
                points = [(s.time, s.rates[name]) for s in run.train_steps if name in s.rates]
                if points:
                    ax.plot(run.since_start([t for t, _ in points]), [v for _, v in points], ".-", markersize=3,
                            label=name)
            has_data = True
        else:
            times, rates = _steps_per_minute(run.train_steps)
            ax.plot(run.since_start(times), rates, ".-", markersize=3,
                    label=f"steps/min (last {RATE_WINDOW_STEPS} steps)")
            has_data = bool(rates)
        _finish(ax, run, f"Throughput: {title}", ylabel, has_data)
    for ax in axes[:-1]:
        ax.set_xlabel("")


def _plot_checkpoint_phases(fig: Figure, run: _Run) -> None:
    ax = fig.subplots()
    completed = [c for c in run.checkpoints if c.outcome == "completed" and c.phases]
    names = [*CHECKPOINT_PHASES, *sorted({p for c in completed for p in c.phases} - set(CHECKPOINT_PHASES))]
    for name in names:
        points = [(c.time, c.phases[name]) for c in completed if name in c.phases]
        if points:
            ax.plot(run.since_start([t for t, _ in points]), [v for _, v in points], ".-", markersize=4,
                    linewidth=2.0 if name == "total" else 1.0, label=name)
    ax.set_ylim(bottom=0)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + 0.15 * (high - low))  # headroom for the skipped/failed band
    for outcome, (colour, height) in _OUTCOME_STYLE.items():
        times = [c.time for c in run.checkpoints if c.outcome == outcome]
        if times:
            # Drawn in a band at the top (axes-fraction y), so they never read as a duration.
            ax.plot(run.since_start(times), [height] * len(times), "x", color=colour, markersize=8,
                    markeredgewidth=2, transform=ax.get_xaxis_transform(), label=outcome)
    _finish(ax, run, "Checkpoint phases (completed checkpoints)", "seconds", bool(run.checkpoints))


def _plot_restore_times(fig: Figure, run: _Run) -> None:
    ax = fig.subplots()
    names = [*RESTORE_PHASES, *sorted({p for r in run.restores for p in r.phases} - set(RESTORE_PHASES))]
    for name in names:
        points = [(r.time, r.phases[name]) for r in run.restores if name in r.phases]
        if points:
            ax.scatter(run.since_start([t for t, _ in points]), [v for _, v in points], s=60 if name == "total" else 30,
                       marker="D" if name == "total" else "o", label=name, zorder=3)
    _finish(ax, run, "Restore phases", "seconds", any(r.phases for r in run.restores))


def _plot_goodput(fig: Figure, run: _Run) -> None:
    fig.set_size_inches(11, 7.0)
    busy_ax, ratio_ax = fig.subplots(2, 1, sharex=True)
    steps = run.train_steps
    for engine in sorted({name for s in steps for name in s.busy}):
        points = [(s.time, s.busy[engine]) for s in steps if engine in s.busy]
        busy_ax.plot(run.since_start([t for t, _ in points]), [v for _, v in points], ".-", markersize=3,
                     label=f"engine {engine} busy")
    for ax, names in ((busy_ax, ("engine_busy_bound",)), (ratio_ax, ("generation_waste_ratio", "goodput_ratio"))):
        for name in names:
            points = [(s.time, s.goodput[name]) for s in steps if name in s.goodput]
            if points:
                ax.plot(run.since_start([t for t, _ in points]), [v for _, v in points], ".-", markersize=3,
                        label=name)
        ax.set_ylim(-0.02, 1.05)
    _finish(busy_ax, run, "Goodput: engine busy ratio and its bound", "share of wall time",
            any(s.busy for s in steps))
    _finish(ratio_ax, run, "Goodput: tokens wasted and trained, of tokens generated (per run)", "ratio",
            any(s.goodput for s in steps))
    busy_ax.set_xlabel("")


def _plot_skew(fig: Figure, run: _Run) -> None:
    """Trained ÷ admitted per bucket (a starved bucket falls below the others) and their distance."""
    fig.set_size_inches(11, 7.0)
    ratio_ax, tvd_ax = fig.subplots(2, 1, sharex=True)
    times = run.since_start([s.time for s in run.skews])
    for bucket in sorted({b for s in run.skews for b in s.trained_per_admitted}):
        points = [(t, s.trained_per_admitted[bucket]) for t, s in zip(times, run.skews, strict=True)
                  if bucket in s.trained_per_admitted]
        ratio_ax.plot([t for t, _ in points], [v for _, v in points], ".-", markersize=3, label=bucket)
    tvd_ax.plot(times, [s.tvd for s in run.skews], ".-", markersize=3, label="training_skew_tvd")
    tvd_ax.set_ylim(-0.02, 1.02)
    _finish(ratio_ax, run, "Skew: trained ÷ admitted prompts per bucket", "trained / admitted", bool(run.skews))
    _finish(tvd_ax, run, "Skew: total variation distance, admitted vs trained over buckets", "TVD",
            bool(run.skews))
    ratio_ax.set_xlabel("")


# Each figure, how it is drawn, and whether the log has anything for it (a figure without is not written).
_PLOTS: tuple[tuple[str, Callable[[Figure, _Run], None], Callable[[_Run], bool]], ...] = (
    ("reward.png", _plot_reward, lambda run: bool(run.train_steps)),
    ("learning.png", _plot_learning, lambda run: any(s.learning for s in run.train_steps)),
    ("eval.png", _plot_eval, lambda run: bool(run.evals)),
    ("throughput.png", _plot_throughput, lambda run: len(run.train_steps) >= 2),
    ("goodput.png", _plot_goodput, lambda run: any(s.busy or s.goodput for s in run.train_steps)),
    ("checkpoint_phases.png", _plot_checkpoint_phases, lambda run: bool(run.checkpoints)),
    ("restore_times.png", _plot_restore_times, lambda run: any(r.phases for r in run.restores)),
    ("skew.png", _plot_skew, lambda run: bool(run.skews)),
)


# ---- summary ----------------------------------------------------------------------------------------


def _seconds(values: Sequence[float], reduce: Callable[[Sequence[float]], float]) -> str:
    return f"{reduce(values):.3f}" if values else "n/a"


def _last_step_of_each_run(run: _Run) -> list[_TrainStep]:
    """The last train step that reported goodput counts, for each run: a process start ends a run, and so
    does a count that goes back (a process that ran the controller more than once)."""
    last: list[_TrainStep] = []
    current: _TrainStep | None = None
    starts = iter(run.starts)
    next_start = next(starts, None)
    for step in (s for s in run.train_steps if "run_generated_tokens" in s.goodput):
        while next_start is not None and next_start <= step.time:
            last += [current] if current else []
            current, next_start = None, next(starts, None)
        if current and step.goodput["run_generated_tokens"] < current.goodput["run_generated_tokens"]:
            last.append(current)
        current = step
    return [*last, current] if current else last


def _totals(run: _Run) -> GoodputTotals:
    last = _last_step_of_each_run(run)
    restore_tokens = sum(r.stale_tokens for r in run.restores)
    return GoodputTotals(
        runs=len(last), generated_tokens=int(sum(s.goodput["run_generated_tokens"] for s in last)),
        wasted_tokens=int(sum(s.goodput.get("run_wasted_tokens", 0) for s in last)) + restore_tokens,
        trained_tokens=int(sum(s.goodput.get("run_trained_tokens", 0) for s in last)),
        restore_stale_groups=sum(r.stale_groups for r in run.restores), restore_stale_tokens=restore_tokens,
    )


def goodput_totals(events_path: Path) -> GoodputTotals:
    """Goodput summed over every run in the event log at ``events_path`` (``ScdError`` as ``write_report``)."""
    return _totals(_load(Path(events_path)))


def _goodput_rows(run: _Run) -> list[tuple[str, str]]:
    last = run.train_steps[-1] if run.train_steps else None
    rows = [(f"engine {engine} busy ratio (last step)", f"{ratio:.3f}")
            for engine, ratio in sorted(last.busy.items())] if last else []
    bound = last.goodput.get("engine_busy_bound") if last else None
    totals = _totals(run)
    measured = totals.generated_tokens > 0
    return [*rows, ("engine busy bound (last step)", f"{bound:.3f}" if bound is not None else "n/a"),
            ("generation waste ratio (all runs)", f"{totals.waste_ratio:.4f}" if measured else "n/a"),
            ("goodput ratio (all runs)", f"{totals.goodput_ratio:.4f}" if measured else "n/a"),
            ("restores: stale groups thrown away", str(totals.restore_stale_groups)),
            ("restores: stale tokens thrown away", str(totals.restore_stale_tokens))]


def _eval_rows(run: _Run) -> list[tuple[str, str]]:
    evals = run.evals_by_step()
    if not evals:
        return [("eval steps", "0")]
    first, last = evals[0], evals[-1]
    return [("eval steps", str(len(evals))),
            (f"eval reward (step {first.step} -> {last.step})", f"{first.reward_mean:.4f} -> {last.reward_mean:.4f}"),
            *((f"eval pass@{k} (step {last.step})", f"{value:.4f}")
              for k, value in sorted(last.pass_at_k.items(), key=lambda kv: int(kv[0])))]


def _sample_lines(title: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["", title]
    for row in rows[:SAMPLE_ROWS]:
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # chat messages: the last one is what the model answers
            prompt = prompt[-1].get("content", "") if prompt and isinstance(prompt[-1], dict) else prompt
        lines.append(f"  {str(prompt)!r} -> {str(row.get('completion', ''))!r}  (answer {row.get('answer')!r}, "
                     f"reward {float(row.get('reward', 0.0)):.3f})")
    return lines


def _summary(path: Path, run: _Run, unwritten: Sequence[str]) -> str:
    steps = run.train_steps
    final = [s.reward_mean for s in steps[-FINAL_REWARD_STEPS:]]
    checkpoint_totals = [c.phases["total"] for c in run.checkpoints if c.outcome == "completed" and "total" in c.phases]
    restore_totals = [r.phases["total"] for r in run.restores if "total" in r.phases]
    by_outcome = Counter(c.outcome for c in run.checkpoints)
    by_reason = Counter((c.outcome, c.reason) for c in run.checkpoints)
    rows = [
        ("run span (s)", f"{run.span:.1f}"),
        ("processes", str(max(1, len(run.starts)))),
        ("restores", str(len(run.restores))),
        ("train steps (max step)", str(max(s.step for s in steps)) if steps else "0"),
        (f"final reward (mean of last {len(final)})", f"{fmean(final):.4f}" if final else "n/a"),
        ("checkpoints", str(len(run.checkpoints))),
    ]
    for outcome in [*_OUTCOMES, *sorted(set(by_outcome) - set(_OUTCOMES))]:
        rows.append((f"checkpoints {outcome}", str(by_outcome[outcome])))
        rows += [(f"  {outcome}, reason {reason}", str(n)) for (o, reason), n in sorted(by_reason.items())
                 if o == outcome]
    rows += [
        ("checkpoint total mean (s)", _seconds(checkpoint_totals, fmean)),
        ("checkpoint total max (s)", _seconds(checkpoint_totals, max)),
        ("restore total mean (s)", _seconds(restore_totals, fmean)),
        *_goodput_rows(run),
        ("training skew TVD (last step)", f"{run.skews[-1].tvd:.4f}" if run.skews else "n/a"),
        *_eval_rows(run),
        ("figures not written (no data)", ", ".join(unwritten) or "none"),
    ]
    width = max(len(label) for label, _ in rows)
    value_width = max(len(value) for _, value in rows)
    lines = [f"scd run report: {path}", f"{'metric':<{width}}  {'value':>{value_width}}",
             f"{'-' * width}  {'-' * value_width}"]
    lines += [f"{label:<{width}}  {value:>{value_width}}" for label, value in rows]
    if run.completions is not None and run.completions.rows:
        lines += _sample_lines(f"sample completions (step {run.completions.step}):", run.completions.rows)
    if run.evals and run.evals[-1].rows:
        lines += _sample_lines(f"held-out eval samples (step {run.evals[-1].step}):", run.evals[-1].rows)
    return "\n".join(lines)


def write_report(events_path: Path, out_dir: Path) -> str:
    """Read the event log at ``events_path``, write the PNG plots into ``out_dir``, return the summary.

    Raises ``ScdError`` for a missing or empty log, a malformed event (naming file and line), or when
    matplotlib (the ``report`` extra) is not installed.  A line that is not JSON (a write a crash tore) is
    skipped with a warning naming it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ScdError("the report needs matplotlib: pip install 'scd[report]'") from exc
    events_path, out_dir = Path(events_path), Path(out_dir)
    run = _load(events_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    unwritten = []
    for name, draw, has_data in _PLOTS:
        if not has_data(run):
            unwritten.append(name)
            continue
        fig = Figure(figsize=(11, 4.2), dpi=100)
        FigureCanvasAgg(fig)
        draw(fig, run)
        fig.tight_layout()
        fig.savefig(out_dir / name)
    return _summary(events_path, run, unwritten)
