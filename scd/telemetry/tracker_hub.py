"""scd's end of the experiment trackers: a process per tracker (``scd.telemetry.tracker_process``), fed
from the event log, never waited on by the event loop.

The loop writes each event-log line the trackers show to each tracker's stdin, never waiting: what its pipe
(``PIPE_BYTES``) does not take is queued, up to ``QUEUE_BYTES``.  When a tracker falls that far behind,
the line is dropped and counted (``scd_tracker_dropped_records_total``), so a slow or hung tracker never
delays a pump.  A tracker that raises (its process reports the error and exits), or whose process dies,
is disabled with one warning and counted (``scd_tracker_errors_total``); the run goes on.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import orjson

from scd import faults
from scd.config import TelemetryConfig
from scd.schema import RunIdentity
from scd.telemetry import metrics
from scd.telemetry.events import EventLog
from scd.telemetry.trackers import require_tracker_packages

log = logging.getLogger(__name__)

# What a tracker may fall behind by before the loop drops lines: minutes of steps at any real step rate.
QUEUE_BYTES = 4 * 1024 * 1024
PIPE_BYTES = 64 * 1024  # and what its stdin holds beyond them
CLOSE_TIMEOUT_S = 30.0  # a tracker still busy then is killed, with a warning
_CLOSE_POLL_S = 0.05


class TrackerFeed:
    """One tracker's process and the bytes queued for it.

    The loop writes to the process's stdin itself, non-blocking: a thread per tracker woken at every
    line would take the interpreter lock from the pumps each time (on 2 cores that alone cost 9% of the
    trainer's steps).  What the pipe does not take now waits in ``_pending`` for the next line or for
    ``close``.
    """

    def __init__(self, name: str, header: bytes, run_of: Callable[[], RunIdentity], env: dict[str, str]) -> None:
        self.name = name
        self._run_of = run_of
        self._lock = threading.Lock()  # the loop offers, close runs in a worker thread
        self._pending = bytearray(header)
        self._sent_run = False
        self._failed = False
        self._stopping = False
        metrics.tracker_errors.labels(name)
        metrics.tracker_dropped.labels(name)
        # In scd's process group: a signal to the whole of scd reaches it too.
        self._process = subprocess.Popen([sys.executable, "-m", "scd.telemetry.tracker_process"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self._process.stdin is not None
        self._stdin = self._process.stdin.fileno()
        fcntl.fcntl(self._stdin, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self._stdin, False)
        threading.Thread(target=self._watch, name=f"scd-tracker-{name}", daemon=True).start()
        self._push()

    def offer(self, line: bytes) -> None:
        """On the event loop: never blocks."""
        with self._lock:
            if self._failed or self._stopping:
                return
            if not self._sent_run:
                # Read at the first line, not before: by then a restore has put the run's identity back.
                self._pending += msgspec.json.encode(self._run_of()) + b"\n"
                self._sent_run = True
            if len(self._pending) + len(line) > QUEUE_BYTES:
                metrics.tracker_dropped.labels(self.name).inc()
            else:
                self._pending += line
            self._push()

    def _push(self) -> None:
        """Write what the pipe takes now (under the lock)."""
        try:
            written = os.write(self._stdin, self._pending) if self._pending else 0
        except BlockingIOError:
            return
        except BrokenPipeError:
            self._failed = True  # the process ended; _watch says why
            return
        del self._pending[:written]

    def _watch(self) -> None:
        assert self._process.stdout is not None
        with self._process.stdout:
            report = self._process.stdout.readline()
        code = self._process.wait()
        if report:
            error = orjson.loads(report)
            self._fail(error["error"], error["traceback"])
        elif code != 0 and not self._stopping:
            self._fail(f"its process exited with code {code}", "")

    def _fail(self, error: str, trace: str) -> None:
        self._failed = True
        metrics.tracker_errors.labels(self.name).inc()
        log.warning("experiment tracker %s raised %s: disabled for the rest of this process; training goes on",
                    self.name, error)
        if trace:
            log.debug("experiment tracker %s: %s", self.name, trace)

    def close(self, deadline: float) -> bool:
        """Hand the tracker what is queued and the end, and wait for it to finish, until ``deadline``
        (monotonic); kill it after.  True if it finished in time.  Blocking: off the loop."""
        with self._lock:
            self._stopping = True
        while self._pending and not self._failed and time.monotonic() < deadline:
            with self._lock:
                self._push()
            if self._pending:
                time.sleep(_CLOSE_POLL_S)
        behind = len(self._pending)
        assert self._process.stdin is not None
        self._process.stdin.close()  # the end of input: the process logs what it read, then closes its tracker
        try:
            self._process.wait(max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            if behind:
                log.warning("experiment tracker %s was %d bytes behind at exit", self.name, behind)
            return False


class TrackerHub:
    """Every listed tracker's feed.  ``offer`` is the event log's hand-off (on the loop, non-blocking);
    ``close`` waits for the trackers, bounded, off the loop."""

    def __init__(self, telemetry: TelemetryConfig, output_dir: Path, run_of: Callable[[], RunIdentity]) -> None:
        require_tracker_packages(telemetry)
        env = {**os.environ, "SCD_FAULT": faults.armed_spec()}
        if "mlflow" in telemetry.trackers and telemetry.mlflow.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told it is wanted: it is this setting's default.
            env.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mark_dir = str((output_dir / "trackers").resolve())
        self.feeds = [
            TrackerFeed(name, orjson.dumps({"name": name, "telemetry": msgspec.to_builtins(telemetry),
                                            "mark_dir": mark_dir}) + b"\n", run_of, env)
            for name in telemetry.trackers]

    def offer(self, line: bytes) -> None:
        for feed in self.feeds:
            feed.offer(line)

    def close(self) -> None:
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for feed in self.feeds:
            if not feed.close(deadline):
                log.warning("experiment tracker %s did not finish within %.0fs: killed; its last records may be lost",
                            feed.name, CLOSE_TIMEOUT_S)


def event_log(telemetry: TelemetryConfig, output_dir: Path, run_of: Callable[[], RunIdentity]) -> EventLog:
    """The log at ``telemetry.events_path``, feeding ``telemetry.trackers`` (``run_of``: the run they show)."""
    trackers = TrackerHub(telemetry, output_dir, run_of) if telemetry.trackers else None
    return EventLog(Path(telemetry.events_path), trackers)
