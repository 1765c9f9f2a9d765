"""Experiment trackers (TensorBoard, Weights & Biases, MLflow): what each one is given, and how.

``telemetry.trackers`` lists them.  Each gets the numbers of every ``train_step`` event (``train/...``:
the same scalars, the skew figure included), and of ``checkpoint``, ``restore`` and ``eval`` events: outcomes
(``checkpoint/completed`` = 1, ...), phases (``checkpoint/phases/tq_save``, ...), recovery counts
(``restore/groups_restored``, ...) and held-out results (``eval/reward_mean``, ``eval/pass_at_k/4``, ...); and
the rows of ``completions`` events, what the policy wrote
(TensorBoard: a text table, W&B: a table, MLflow: a JSON artifact per step), each only with its train step.
Two axes: the trainer step, and ``time/run_s``, the wall-clock seconds since the logical run first started,
which go on across restarts (each tracker's own timestamp is the event's absolute time).  W&B plots
everything against ``trainer/step``.

Each tracker runs in a process of its own (``scd.telemetry.tracker_process``), fed by scd's
``scd.telemetry.tracker_hub``; this module is what that process runs, and the check scd makes first.

One logical run across restarts: its identity (``RunIdentity``) is part of every checkpoint cut.
TensorBoard writes to ``<tensorboard.dir>/<run id>``, W&B resumes the run with that id, MLflow the run
tagged ``scd.run_id`` with it.  A restore trains again the steps after its bundle's cut, which the trackers
may already hold from before the crash: each tracker keeps the highest train step it logged, per run, in
``<run.output_dir>/trackers/<name>.jsonl``, written before the step is logged, so no tracker ever gets a
train step twice (``events.jsonl`` keeps both).
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from scd.config import MlflowConfig, TelemetryConfig, TensorBoardConfig, WandbConfig
from scd.errors import ConfigError
from scd.schema import Outcome, RunIdentity
from scd.telemetry.events import Checkpoint, Completions, Eval, Restore, TrainStep, tag_of

log = logging.getLogger(__name__)

STEP_KEY = "trainer/step"  # W&B's step axis (TensorBoard and MLflow have a step of their own)
TIME_KEY = "time/run_s"
MLFLOW_RUN_TAG = "scd.run_id"

# The import each tracker needs, checked before Ray starts.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# What each tracker's process imports as it starts, while the controller starts and restores.
MODULES = {"tensorboard": "tensorboard.summary.writer.event_file_writer", "wandb": "wandb",
            "mlflow": "mlflow.tracking"}
# The events trackers are sent (``scd.telemetry.events.TRACKED``), by the tag of their lines, and the prefix of
# their scalars.
_TRAIN_STEP, _CHECKPOINT, COMPLETIONS = tag_of(TrainStep), tag_of(Checkpoint), tag_of(Completions)
_COMPLETION_COLUMNS = ("epoch", "prompt_id", "prompt", "completion", "answer", "reward")
_PREFIXES = {_TRAIN_STEP: "train/", _CHECKPOINT: "checkpoint/", tag_of(Restore): "restore/", tag_of(Eval): "eval/"}
_AXES = frozenset({"event", "time", "step"})


def require_tracker_packages(telemetry: TelemetryConfig) -> None:
    """Every listed tracker's package is importable; else a ``ConfigError`` naming the key and the extra."""
    missing = [name for name in telemetry.trackers if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ConfigError("telemetry.trackers", (
            f"lists {', '.join(missing)}, whose package is not installed ({', '.join(PACKAGES[m] for m in missing)}): "
            "pip install 'scd[trackers]', or remove it from the list"))


@dataclass(frozen=True, slots=True)
class TrackerPoint:
    step: int
    time: float  # the event's absolute wall-clock time
    scalars: dict[str, float]
    train: bool  # a train step: each tracker logs a step once per run


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def point_of(record: Mapping[str, Any], run: RunIdentity) -> TrackerPoint | None:
    """The scalars of one event-log line as JSON, or None for an event trackers do not show.

    Numbers and one level of nested numbers (phases, per-bucket ratios) become scalars; text and
    lists do not, except a checkpoint's outcome, which becomes ``checkpoint/<outcome>`` = 1.
    """
    kind = record.get("event")
    prefix = _PREFIXES.get(kind) if isinstance(kind, str) else None
    # A scheduled checkpoint is not an outcome yet: its completed or failed record follows.
    if prefix is None or (kind == _CHECKPOINT and record.get("outcome") == Outcome.SCHEDULED):
        return None
    at = float(record["time"])
    scalars = {TIME_KEY: at - run.started_at}
    if kind == _CHECKPOINT:
        scalars[f"checkpoint/{record['outcome']}"] = 1.0
    for key, value in record.items():
        if key in _AXES:
            continue
        if _is_number(value):
            scalars[prefix + key] = float(value)
        elif isinstance(value, Mapping):
            scalars.update((f"{prefix}{key}/{inner}", float(v)) for inner, v in value.items() if _is_number(v))
    return TrackerPoint(int(record["step"]), at, scalars, kind == _TRAIN_STEP)


@dataclass(frozen=True, slots=True)
class CompletionRows:
    """A ``completions`` event's rows, each cell as text (a chat prompt as ``role: content`` lines)."""

    step: int
    time: float
    rows: list[tuple[str, ...]]  # in _COMPLETION_COLUMNS' order

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> CompletionRows:
        return cls(int(record["step"]), float(record["time"]),
                   [tuple(_cell(row[column]) for column in _COMPLETION_COLUMNS) for row in record["rows"]])

    def markdown(self) -> str:
        def escaped(cell: str) -> str:
            return cell.replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(_COMPLETION_COLUMNS) + " |", "|" + "---|" * len(_COMPLETION_COLUMNS)]
        lines += ["| " + " | ".join(map(escaped, row)) + " |" for row in self.rows]
        return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) and {"role", "content"} <= m.keys() for m in value):
        return "\n".join(f"{m['role']}: {m['content']}" for m in value)
    return orjson.dumps(value).decode()


class Tracker(Protocol):
    def log(self, point: TrackerPoint) -> None: ...

    def log_completions(self, completions: CompletionRows) -> None: ...

    def flush(self) -> None:
        """Make what was logged durable (called when the queue runs empty)."""
        ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, config: TensorBoardConfig, run: RunIdentity) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        # Each process adds an event file to the run's directory: TensorBoard reads them as one run.
        self._writer = EventFileWriter(str(Path(config.dir) / run.run_id))

    def log(self, point: TrackerPoint) -> None:
        # One event carries every scalar of the point: an event per scalar costs about 8x the CPU.
        values = [self._summary.Value(tag=key, simple_value=value) for key, value in point.scalars.items()]
        self._writer.add_event(self._event(wall_time=point.time, step=point.step, summary=self._summary(value=values)))

    def log_completions(self, completions: CompletionRows) -> None:
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto

        # What TensorBoard's text plugin reads: a string tensor of markdown.
        value = self._summary.Value(
            tag=COMPLETIONS, metadata=SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text")),
            tensor=TensorProto(dtype=types_pb2.DT_STRING, string_val=[completions.markdown().encode()]))
        self._writer.add_event(self._event(wall_time=completions.time, step=completions.step,
                                           summary=self._summary(value=[value])))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, config: WandbConfig, run: RunIdentity) -> None:
        import wandb

        # console="off": W&B would otherwise wrap this process's stdout and stderr.
        self._run = wandb.init(project=config.project, id=run.run_id, resume="allow", mode=config.mode,
                               dir=config.dir, settings=wandb.Settings(console="off", disable_git=True, silent=True))
        # W&B's own step counts log calls, which restart with each process; the trainer step is the axis.
        self._run.define_metric(STEP_KEY)
        self._run.define_metric(TIME_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def log(self, point: TrackerPoint) -> None:
        self._run.log({STEP_KEY: point.step, **point.scalars})

    def log_completions(self, completions: CompletionRows) -> None:
        import wandb

        table = wandb.Table(columns=list(_COMPLETION_COLUMNS), data=[list(row) for row in completions.rows])
        self._run.log({STEP_KEY: completions.step, COMPLETIONS: table})

    def flush(self) -> None:
        """W&B's own service writes and uploads in the background."""

    def close(self) -> None:
        self._run.finish()


_MLFLOW_UNSAFE = re.compile(r"[^\w\-. /:]")  # what MLflow refuses in a metric name


class MlflowTracker:
    def __init__(self, config: MlflowConfig, run: RunIdentity) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=config.tracking_uri)
        experiment = self._client.get_experiment_by_name(config.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(config.experiment,
                                                             artifact_location=config.artifact_location or None))
        found = self._client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{run.run_id}'",
                                         max_results=1)
        if found:
            self._run_id = found[0].info.run_id
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = self._client.create_run(experiment_id, tags={MLFLOW_RUN_TAG: run.run_id},
                                                   run_name=f"scd-{run.run_id}").info.run_id

    def log(self, point: TrackerPoint) -> None:
        at_ms = int(point.time * 1000)
        batch = [self._metric(_MLFLOW_UNSAFE.sub("_", key), value, at_ms, point.step)
                 for key, value in point.scalars.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def log_completions(self, completions: CompletionRows) -> None:
        rows = [dict(zip(_COMPLETION_COLUMNS, row, strict=True)) for row in completions.rows]
        self._client.log_text(self._run_id, orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode(),
                              f"{COMPLETIONS}/step_{completions.step:08d}.json")

    def flush(self) -> None:
        """Every ``log_batch`` is written when it returns."""

    def close(self) -> None:
        self._client.set_terminated(self._run_id, "FINISHED")


def open_tracker(name: str, telemetry: TelemetryConfig, run: RunIdentity) -> Tracker:
    """Blocking: W&B starts its service, MLflow searches its runs."""
    if name == "tensorboard":
        return TensorBoardTracker(telemetry.tensorboard, run)
    if name == "wandb":
        return WandbTracker(telemetry.wandb, run)
    return MlflowTracker(telemetry.mlflow, run)


class StepMark:
    """The highest train step one tracker logged in one run, kept across restarts.

    An append-only line per step, not a file replaced per step: a rename per step makes ext4 write the
    new file's blocks out first (its replace-by-rename safeguard), which on a 2-core box slowed the
    trainer beside it by several percent.  A line torn by a crash is skipped: the step it was for had
    not been logged yet.  Opening keeps only the newest line.
    """

    def __init__(self, path: Path, run_id: str) -> None:
        self._run_id = run_id
        self.step = self._read(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(self._line(self.step))
        os.replace(tmp, path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def _line(self, step: int) -> bytes:
        return orjson.dumps({"run_id": self._run_id, "step": step}) + b"\n"

    def _read(self, path: Path) -> int:
        try:
            lines = path.read_bytes().splitlines()
        except FileNotFoundError:
            return 0
        steps = []
        for line in lines:
            try:
                saved = orjson.loads(line)
                steps.append(int(saved["step"]) if saved["run_id"] == self._run_id else 0)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        if lines and not steps:
            log.warning("%s is not a tracker step mark: the tracker may get train steps it already holds", path)
        return max(steps, default=0)

    def advance(self, step: int) -> None:
        self.step = step
        os.write(self._fd, self._line(step))
