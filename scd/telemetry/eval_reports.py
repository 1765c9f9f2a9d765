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

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import orjson

from scd import faults
from scd.telemetry import metrics
from scd.telemetry.events import Eval, EventLog

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


def unreported(records: Sequence[dict[str, Any]], log: Path, since: float) -> list[dict[str, Any]]:
    """Those of ``records`` (a bundle's held evaluations, cut at ``since``) that the event log at ``log`` has
    no line of stamped at or after ``since`` (blocking).  The log is in time order: it is read from its
    end back to its first older line; a torn last line (a crash mid-write) is no report."""
    if not records or not log.exists():
        return list(records)
    logged: list[dict[str, Any]] = []
    with log.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        unsplit = b""  # read, not yet taken as lines: the start of the earliest line read so far
        tail_dropped = False
        while end > 0:
            start = max(0, end - READ_BLOCK_BYTES)
            f.seek(start)
            lines = (f.read(end - start) + unsplit).split(b"\n")
            end = start
            if not tail_dropped:
                if len(lines) == 1 and end > 0:
                    unsplit = lines[0]  # no newline yet: the last line is longer than a block
                    continue
                lines.pop()  # after the log's last newline: nothing, or a torn line
                tail_dropped = True
            unsplit = lines.pop(0) if end > 0 else b""
            for line in reversed(lines):
                event = orjson.loads(line)
                if event["time"] < since:
                    return [r for r in records if r not in logged]
                if event["event"] == "eval":
                    del event["time"]
                    logged.append(event)
    return [r for r in records if r not in logged]
