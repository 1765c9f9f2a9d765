"""Held-out evaluations' reports, each made once: its ``eval`` event (the event log, so the trackers) and the
``scd_eval_*`` gauges.

A finished evaluation is held by the controller state (``ControllerState.held_evals``) and reported once the
bundle of the next cut, which holds it, is committed (the checkpointer).  A crash before that commit loses
the evaluation with its bundle: no report was made of it, and the restored run evaluates the step again.  A
crash between the commit and the report leaves a bundle that holds an evaluation the event log lacks: the
restore from it reports that one (``unreported``), and none that the log has a line of since the cut.
Without checkpointing nothing is restored and an evaluation is reported as it finishes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import orjson

from scd import faults
from scd.telemetry import metrics
from scd.telemetry.events import Eval, EventLog

log = logging.getLogger(__name__)

READ_BLOCK_BYTES = 1 << 20  # the event log is read back from its end in blocks of this many bytes


def held_record(event: Eval) -> dict[str, Any]:
    """What the state and a bundle hold of a finished evaluation: its event's fields, but its time (stamped as
    it is reported)."""
    record: dict[str, Any] = msgspec.to_builtins(event)
    del record["time"]
    return record


async def report_evals(records: Sequence[dict[str, Any]], events: EventLog) -> None:
    """Emit each evaluation's event and publish its numbers on the gauges, in order."""
    for record in records:
        event = msgspec.convert(record, Eval)
        await events.emit(event)
        metrics.eval_reward_mean.set(event.reward_mean)
        metrics.eval_step.set(event.step)
        for k, value in event.pass_at_k.items():
            metrics.eval_pass_at_k.labels(k).set(value)
        await faults.wait_at("after_eval_report")


def unreported(records: Sequence[dict[str, Any]], path: Path, since: float) -> list[dict[str, Any]]:
    """Those of ``records`` (a bundle's held evaluations, cut at ``since``) that the event log at ``path`` has
    no line of stamped at or after ``since`` (blocking).  The log is in time order: it is read from its end
    back to its first older line.  A line that does not decode (torn by a crash mid-write) is no report,
    wherever it is: this run's own events, the restore's among them, are appended after it before this reads."""
    if not records or not path.exists():
        return list(records)
    logged: list[dict[str, Any]] = []
    torn = 0
    with path.open("rb") as f:
        for line in _lines_from_end(f):
            if not line:
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                torn += 1
                continue
            if event["time"] < since:
                break
            if event["event"] == "eval":
                del event["time"]
                logged.append(event)
    if torn:
        log.warning("%s: %d line%s that does not decode (torn by a crash mid-write?) skipped", path, torn,
                    "" if torn == 1 else "s")
    return [r for r in records if r not in logged]


def _lines_from_end(f: BinaryIO) -> Iterator[bytes]:
    """The lines of the file open in ``f``, last first, read in blocks from its end (the empty one after its
    last newline first)."""
    end = f.seek(0, os.SEEK_END)
    unsplit = b""  # read, not yet taken as lines: the start of the earliest line read so far
    while end > 0:
        start = max(0, end - READ_BLOCK_BYTES)
        f.seek(start)
        lines = (f.read(end - start) + unsplit).split(b"\n")
        end = start
        unsplit = lines.pop(0) if end > 0 else b""
        yield from reversed(lines)
