"""The JSONL event log: one typed event per line, stamped with wall-clock time.

Each kind scd emits is a struct here (``TrainStep``, ``Checkpoint``, ...); its tag is the line's
``event`` key, its fields the line's other keys.  Appended across restarts, so a series continues
where the last process left it.  Events are stamped and written one at a time, so the file is in time
order.  The line of each event the trackers show (``TRACKED``) is also handed to the experiment
trackers (``scd.telemetry.tracker_hub``), which take it off the loop; closing the log (``async with``)
waits for them, bounded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

import aiofiles
import anyio
import msgspec
from aiofiles.threadpool.binary import AsyncBufferedReader


class Event(msgspec.Struct, tag_field="event"):
    step: int  # the trainer step
    time: float = 0.0  # stamped as the log writes the event


class Start(Event, tag="start", kw_only=True):
    """A process began: before its restore."""

    pid: int
    tq_controller_node: str
    tq_storage_unit_nodes: list[str]


class Restore(Event, tag="restore", kw_only=True):
    bundle: str
    phases: dict[str, float]
    groups_restored: int
    groups_evicted_stale: int
    prompts_redispatched: int
    shadow: bool
    uncut_groups_cleared: int
    siblings_reused: int
    siblings_rerun: int
    stale_tokens: int
    prefix_tokens_reused: int
    prefix_tokens_dropped: int
    siblings_resumed: int
    scores_reused: int = 0  # finished siblings restored with their score: never scored again
    scores_owed: int = 0  # finished siblings restored without one: scored, not generated again
    # Optimizer settings the config changed from the bundle's, [old, new] by key: the config's apply.
    optimizer_changes: dict[str, list[float]] = msgspec.field(default_factory=dict)
    # Likewise the loss, the lr schedule and dynamic sampling (scd.config.Config.training_settings).
    training_changes: dict[str, list[Any]] = msgspec.field(default_factory=dict)
    # The reward set's settings the config changed from the bundle's, [old, new] by key: the config's apply;
    # the ready groups restored (groups_rescored) were scored again under them.
    reward_changes: dict[str, list[Any]] = msgspec.field(default_factory=dict)
    groups_rescored: int = 0


class Checkpoint(Event, tag="checkpoint", kw_only=True):
    """One checkpoint attempt's outcome; the fields an outcome has not are left out of the line."""

    outcome: str
    reason: str
    since_last_success_s: float | None
    trigger: str | msgspec.UnsetType = msgspec.UNSET  # skipped, failed
    error: str | msgspec.UnsetType = msgspec.UNSET  # failed
    bundle: str | msgspec.UnsetType = msgspec.UNSET  # completed, and the rest below
    phases: dict[str, float] | msgspec.UnsetType = msgspec.UNSET
    groups: int | msgspec.UnsetType = msgspec.UNSET
    cost_s: float | msgspec.UnsetType = msgspec.UNSET
    interval_s: float | msgspec.UnsetType = msgspec.UNSET
    sidecar_bytes: int | msgspec.UnsetType = msgspec.UNSET
    data_plane_bytes: int | msgspec.UnsetType = msgspec.UNSET


class TrainStep(Event, tag="train_step", kw_only=True):
    epoch: int
    weight_version: int
    reward_mean: float
    loss: float
    clip_fraction: float
    entropy: float
    trained_tokens: int
    logprob_mismatch_mean: float | None
    logprob_mismatch_max: float | None
    logprob_mismatch_tokens: int
    slowest_rank_ms: float
    fastest_rank_ms: float
    staleness: int
    prompt_ids: list[list[int]]  # [epoch, prompt id] of each group trained
    weight_sync_ms: float
    weight_export_ms: float
    tq_read_ms: float
    training_skew_tvd: float
    trained_per_admitted: dict[str, float]
    committed_groups_per_s: float
    generated_tokens_per_s: float
    committed_tokens_per_s: float
    engine_busy_ratio: dict[str, float]
    engine_busy_bound: float | None
    trainer_groups_per_s: float | None
    generation_groups_per_s: float | None
    trainer_starved_ratio: float
    generation_waste_ratio: float
    goodput_ratio: float
    run_generated_tokens: int  # run_*: counts since this process's run started
    run_wasted_tokens: int
    run_trained_tokens: int
    run_filtered_tokens: int  # of groups filtered for zero reward variance (async_rl.drop_zero_variance_groups)
    # Of the complete completions generated since the last step (None: there were none).
    truncation_rate: float | None  # the share that ended at generation.max_new_tokens
    completion_tokens_mean: float | None
    # Each reward's (and reward part's) unweighted mean over the step's completions, by name.
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    # scd_train_is_ratio's numbers as "staleness/stat": the mean and max proximal / behaviour ratio, and the
    # share of tokens the off-policy correction capped or masked ("clipped_share").
    is_ratio: dict[str, float] = msgspec.field(default_factory=dict)
    # By staleness: the mean per-token k3 estimate of KL(behaviour || proximal).
    behaviour_kl: dict[str, float] = msgspec.field(default_factory=dict)
    lr: float | None = None  # of the step's optimizer step (None in logs from before it was recorded)


class SampleRow(msgspec.Struct, kw_only=True):
    """One completion a train step trained on, as a person reads it."""

    epoch: int
    prompt_id: int
    prompt: Any  # the dataset's prompt field as given: text, or chat messages
    completion: str
    answer: Any
    reward: float


class Completions(Event, tag="completions", kw_only=True):
    """A few of a train step's completions (``telemetry.sample_every_steps``)."""

    rows: list[SampleRow]


class Eval(Event, tag="eval", kw_only=True):
    """A held-out evaluation at a step (``[eval]``): its samples' mean reward and unbiased pass@k."""

    weight_version: int
    prompts: int
    samples_per_prompt: int
    reward_mean: float
    pass_at_k: dict[str, float]  # by k (as text: a JSON key), 1 and the powers of 2 up to samples_per_prompt
    reward_components: dict[str, float]  # each reward's (and part's) unweighted mean, by name
    seconds: float
    tokens: int
    rows: list[SampleRow]  # a few samples, the first sample of the first prompts


class Sample(Event, tag="sample", kw_only=True):
    """The telemetry interval's gauges."""

    weight_version: int
    epoch: int
    replay_groups: int
    replay_rows: int
    in_flight: int
    committed_groups: int
    generated_tokens: int
    ledger: dict[str, int]


class Stall(Event, tag="stall", kw_only=True):
    """Training went without a step for longer than its limit (one per stall)."""

    idle_s: float
    limit_s: float
    in_flight: int
    awaiting_commit: int
    replay_groups: int


TRACKED = (TrainStep, Checkpoint, Restore, Completions, Eval)  # what experiment trackers show


def tag_of(kind: type[Event]) -> str:
    """The ``event`` key of ``kind``'s lines."""
    return str(kind.__struct_config__.tag)


class Trackers(Protocol):
    def offer(self, line: bytes) -> None:
        """On the event loop: never blocks."""
        ...

    def close(self) -> None:
        """Blocking: waits for the trackers, bounded."""
        ...


async def _ends_torn(f: AsyncBufferedReader) -> bool:
    """Whether the file open in ``f`` is not empty and its last byte ends no line."""
    size = await f.seek(0, os.SEEK_END)
    if size == 0:
        return False
    await f.seek(size - 1)
    return bool(await f.read(1) != b"\n")


class EventLog:
    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = path
        self.trackers = trackers
        self._lock = anyio.Lock()
        self._appended = False  # whether this process has written a line: the log's last one is whole then

    async def emit(self, event: Event) -> None:
        async with self._lock:
            line = msgspec.json.encode(msgspec.structs.replace(event, time=time.time())) + b"\n"
            async with aiofiles.open(self.path, "a+b") as f:
                # A crash mid-write leaves the last line torn: this process's first event goes on a line of
                # its own, not glued to it (and lost with it when the log is read back).
                torn = not self._appended and await _ends_torn(f)
                await f.write(b"\n" + line if torn else line)
                self._appended = True
            if self.trackers is not None and isinstance(event, TRACKED):
                self.trackers.offer(line)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self.trackers is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.trackers.close)
