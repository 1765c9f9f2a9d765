"""One experiment tracker in a process of its own: ``python -m scd.telemetry.tracker_process``.

Why a process and not a thread of scd's: a tracker's Python work (MLflow's file store opens a file per
metric, W&B serializes every row) holds the interpreter lock beside the pumps, and on a 2-core box took
8% of the trainer's steps; a tracker hung in C code would hold it for good.  Here a tracker shares
nothing with scd but two pipes, and runs at a lower CPU priority (``NICENESS``): on a busy box the
pumps go first and the tracker catches up when they wait (its queue holds minutes of lines; past
that it drops them, counted).  Its own children (W&B's service) inherit the priority.

The pipes (``scd.telemetry.tracker_hub`` is the other end):

- stdin: a header line ``{"name", "telemetry", "mark_dir"}``; then, once scd knows the run it resumed,
  the ``RunIdentity``; then event-log lines as ``events.jsonl`` holds them.
- stdout, as it was at start (fd 1 is then pointed at stderr, so a library's prints cannot corrupt
  it): one ``{"error", "traceback"}`` line if the tracker raised, after which the process exits 1.

At EOF on stdin, or when scd's process is gone (its pidfd, as ``scd.reaper`` watches it: a fork of
scd may still hold the pipe), the tracker logs what it was sent and closes; ``CLOSE_TIMEOUT_S``
bounds that, so it always dies with scd.
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import threading
import traceback
from pathlib import Path
from typing import BinaryIO

import msgspec
import orjson

from scd import faults, reaper
from scd.config import TelemetryConfig
from scd.schema import RunIdentity
from scd.telemetry.trackers import COMPLETIONS, MODULES, CompletionRows, StepMark, open_tracker, point_of

# Under contention a tracker gets about a tenth of a pump's CPU share (CFS weights 110 vs 1024): behind,
# never starved.  SCHED_IDLE starved it outright on a busy 2-core box: W&B had not started its run when
# scd was killed.
NICENESS = 10
# Within scd's own bound (tracker_hub.CLOSE_TIMEOUT_S), so a tracker ends itself before scd would kill it.
CLOSE_TIMEOUT_S = 20.0
# Lines read ahead of the tracker: the pipe is the buffer scd bounds, so this only decouples reading
# (watching for EOF) from logging.
READ_AHEAD_LINES = 2
READ_BUFFER_BYTES = 4096


class Closing:
    """Ends the tracker once, from EOF or from scd's death: what is queued is logged, within the bound."""

    def __init__(self, lines: queue.Queue[bytes | None]) -> None:
        self._lines = lines
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        # A tracker hung in its own code never reads the end: the timer ends the process anyway.
        threading.Timer(CLOSE_TIMEOUT_S, os._exit, (0,)).start()
        self._lines.put(None)


def serve(name: str, telemetry: TelemetryConfig, mark_dir: Path, lines: queue.Queue[bytes | None],
          report: BinaryIO) -> None:
    """The tracker's thread: log every point, each train step once per run; ends the process."""
    tracker = None
    try:
        importlib.import_module(MODULES[name])
        first = lines.get()
        if first is None:
            os._exit(0)
        run = msgspec.json.decode(first, type=RunIdentity)
        mark = StepMark(mark_dir / f"{name}.jsonl", run.run_id)
        logged_step = -1  # the last train step this process logged: a completions event goes with it only
        while (line := lines.get()) is not None:
            record = orjson.loads(line)
            if record.get("event") == COMPLETIONS:
                if record["step"] == logged_step and tracker is not None:
                    tracker.log_completions(CompletionRows.of(record))
                continue
            point = point_of(record, run)
            if point is None:
                continue
            # Opened before the first step is marked: a mark is a promise that its step is logged, and opening
            # can take seconds (MLflow creates its database), a window in which a SIGKILL would break it.
            if tracker is None:
                tracker = open_tracker(name, telemetry, run)
            if point.train:
                if point.step <= mark.step:
                    continue  # logged before a crash, trained again after the restore
                mark.advance(point.step)
                logged_step = point.step
            faults.hit(f"{name}_log")
            tracker.log(point)
            if lines.empty():
                tracker.flush()
        if tracker is not None:
            tracker.close()
    except Exception as exc:
        report.write(orjson.dumps({"error": repr(exc), "traceback": traceback.format_exc()}) + b"\n")
        if tracker is not None:
            try:
                tracker.close()
            except Exception as close_error:
                sys.stderr.write(f"scd: closing the failed tracker {name} raised too: {close_error!r}\n")
        os._exit(1)
    os._exit(0)


def watch_parent(parent: int, closing: Closing) -> None:
    lineage = reaper.open_lineage(parent)
    if lineage.pidfds:
        reaper.wait_readable(lineage.pidfds)  # until scd has exited
    closing.start()


def main() -> None:
    report = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    os.nice(NICENESS)  # inherited by W&B's service
    parent = os.getppid()
    stdin = open(0, "rb", buffering=READ_BUFFER_BYTES, closefd=False)
    header = orjson.loads(stdin.readline())
    telemetry = msgspec.convert(header["telemetry"], TelemetryConfig)
    lines: queue.Queue[bytes | None] = queue.Queue(READ_AHEAD_LINES)
    closing = Closing(lines)
    threading.Thread(target=serve, args=(header["name"], telemetry, Path(header["mark_dir"]), lines, report),
                     name="tracker", daemon=True).start()
    threading.Thread(target=watch_parent, args=(parent, closing), name="parent-watch", daemon=True).start()
    for line in stdin:
        lines.put(line)
    closing.start()
    threading.Event().wait()  # the tracker's thread, or the close timer, ends the process


if __name__ == "__main__":
    main()
