"""The JSONL event log: one object per line, stamped with wall-clock time and trainer step.

Appended across restarts, so a series continues where the last process left it.
Records are stamped and written one at a time, so the file is in time order.  Each
line is also handed to the experiment trackers (``scd.telemetry.tracker_hub``), which
take it off the loop; closing the log (``async with``) waits for them, bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiofiles
import anyio
import orjson

from scd.config import TelemetryConfig
from scd.schema import RunIdentity
from scd.telemetry.tracker_hub import TrackerHub


class EventLog:
    def __init__(self, path: Path, trackers: TrackerHub | None = None) -> None:
        self.path = path
        self.trackers = trackers
        self._lock = anyio.Lock()

    @classmethod
    def with_trackers(cls, telemetry: TelemetryConfig, output_dir: Path, run_of: Callable[[], RunIdentity]) -> Self:
        """The log at ``telemetry.events_path``, feeding ``telemetry.trackers`` (``run_of``: the run they show)."""
        trackers = TrackerHub(telemetry, output_dir, run_of) if telemetry.trackers else None
        return cls(Path(telemetry.events_path), trackers)

    async def emit(self, event: str, step: int, **fields: Any) -> None:
        async with self._lock:
            record = {"event": event, "time": time.time(), "step": step, **fields}
            line = orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"
            async with aiofiles.open(self.path, "ab") as f:
                await f.write(line)
            if self.trackers is not None:
                self.trackers.offer(event, line)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self.trackers is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.trackers.close)
