"""Fault points for crash, disk-error and stall tests: ``SCD_FAULT=<point>[:<n>][=<action>][,...]``.

At the n-th passage (default 1) of a named point the process dies with
``os._exit(137)`` (action ``exit``, like a SIGKILL: no cleanup, no flush), the
point raises ``OSError(ENOSPC)`` (action ``enospc``, a full disk) or
``FaultInjected`` (action ``fail``, an error in the code there), or, at a
point passed on the event loop (``wait_at``), the task passing it waits forever
(action ``block``, a hung dependency) or ``SLOW_S`` seconds (action ``slow``, a
slow save); at a tracker's point (``<tracker>_log``, passed in the tracker's own
process, which is given this process's spec) the tracker hangs there (``block``).
A point named more than once acts at
each passage named (``mid_weight_broadcast:1=fail,mid_weight_broadcast:2=fail``).
Unset in production; passing a point is then one dict lookup.  In-process tests
arm points for a block with ``armed``.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

POINTS = (
    "before_barrier", "in_exclusive_hold", "post_cut_commit", "after_tq_save", "during_deferred_clear",
    "mid_sidecar_write", "before_finalize_rename",
    "after_finalize_before_latest", "during_retention", "during_restore_tq_load", "during_restore_index",
    "before_dispatch", "mid_weight_broadcast", "during_weight_reload", "during_eval", "after_eval_report",
    "tensorboard_log", "wandb_log", "mlflow_log",
)
ACTIONS = ("exit", "enospc", "block", "fail", "slow")
# Passed with ``wait_at``.
EVENT_LOOP_POINTS = ("before_dispatch", "in_exclusive_hold", "during_eval", "after_eval_report")
TRACKER_POINTS = ("tensorboard_log", "wandb_log", "mlflow_log")  # passed in a tracker's process: they may block
SLOW_S = 0.5


class FaultInjected(RuntimeError):
    """Raised at a fault point armed with the ``fail`` action."""


def _parse(spec: str) -> dict[str, tuple[list[int], dict[int, str]]]:
    """Per point: [passages so far], and the action due at each passage named."""
    faults: dict[str, tuple[list[int], dict[int, str]]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, action = item.partition("=")
        point, _, count = target.partition(":")
        action = action or "exit"
        if (point not in POINTS or action not in ACTIONS or (count and not count.isdigit())
                or (action == "block" and point not in EVENT_LOOP_POINTS + TRACKER_POINTS)
                or (action == "slow" and point not in EVENT_LOOP_POINTS)):
            raise SystemExit(f"scd: error: SCD_FAULT={spec!r}: unknown point or action in {item!r}; "
                             f"points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)} "
                             f"(block only at {', '.join(EVENT_LOOP_POINTS + TRACKER_POINTS)}; "
                             f"slow only at {', '.join(EVENT_LOOP_POINTS)})")
        faults.setdefault(point, ([0], {}))[1][int(count or 1)] = action
    return faults


_FAULTS = _parse(os.environ.get("SCD_FAULT", ""))
_spec = os.environ.get("SCD_FAULT", "")  # what _FAULTS was parsed from: a tracker's process is given it


def armed_spec() -> str:
    """The ``SCD_FAULT`` spec armed now, for a process of scd's own that passes points of its own."""
    return _spec


@contextmanager
def armed(spec: str) -> Iterator[None]:
    """Inside the block, this process's fault points are the ones ``SCD_FAULT=spec`` names (passages
    counted from the block's start); the ones before come back after it."""
    global _spec
    before, before_spec = dict(_FAULTS), _spec
    _FAULTS.clear()
    _FAULTS.update(_parse(spec))
    _spec = spec
    try:
        yield
    finally:
        _FAULTS.clear()
        _FAULTS.update(before)
        _spec = before_spec


def _fires(point: str) -> str | None:
    """The action due at this passage of ``point``, if any."""
    fault = _FAULTS.get(point)
    if fault is None:
        return None
    passages, actions = fault
    passages[0] += 1
    return actions.get(passages[0])


async def wait_at(point: str) -> None:
    """Pass fault point ``point`` on the event loop: blocks forever there, dies or raises if SCD_FAULT says so."""
    action = _fires(point)
    if action == "block":
        sys.stderr.write(f"scd: SCD_FAULT: blocking at {point}\n")
        await anyio.sleep_forever()
    if action == "slow":
        await anyio.sleep(SLOW_S)
    elif action is not None:
        _act(point, action)


def hit(point: str) -> None:
    """Pass fault point ``point``; dies or raises there if SCD_FAULT says so (or hangs, at a tracker's)."""
    action = _fires(point)
    if action == "block":
        sys.stderr.write(f"scd: SCD_FAULT: blocking at {point}\n")
        threading.Event().wait()  # for good: a hung tracker
    elif action is not None:
        _act(point, action)


def _act(point: str, action: str) -> None:
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (SCD_FAULT at {point})")
    if action == "fail":
        raise FaultInjected(f"SCD_FAULT at {point}")
    sys.stderr.write(f"scd: SCD_FAULT: exiting at {point}\n")
    sys.stderr.flush()
    os._exit(137)
