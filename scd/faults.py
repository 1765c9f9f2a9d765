"""Fault points for crash and disk-error tests: ``SCD_FAULT=<point>[:<n>][=<action>][,...]``.

At the n-th passage (default 1) of a named point the process dies with
``os._exit(137)`` (action ``exit``, like a SIGKILL: no cleanup, no flush) or
the point raises ``OSError(ENOSPC)`` (action ``enospc``, a full disk).  Unset
in production; ``hit`` is then one dict lookup.  In-process tests arm points
for a block with ``armed``.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

POINTS = (
    "before_barrier", "in_exclusive_hold", "post_cut_commit", "after_tq_save", "during_deferred_clear",
    "mid_sidecar_write", "before_finalize_rename",
    "after_finalize_before_latest", "during_retention", "during_restore_tq_load", "during_restore_index",
)
ACTIONS = ("exit", "enospc")


def _parse(spec: str) -> dict[str, list[int | str]]:
    faults: dict[str, list[int | str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, action = item.partition("=")
        point, _, count = target.partition(":")
        action = action or "exit"
        if point not in POINTS or action not in ACTIONS or (count and not count.isdigit()):
            raise SystemExit(f"scd: error: SCD_FAULT={spec!r}: unknown point or action in {item!r}; "
                             f"points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)}")
        faults[point] = [int(count or 1), action]
    return faults


_FAULTS = _parse(os.environ.get("SCD_FAULT", ""))


@contextmanager
def armed(spec: str) -> Iterator[None]:
    """Inside the block, this process's fault points are the ones ``SCD_FAULT=spec`` names (passages
    counted from the block's start); the ones before come back after it."""
    before = dict(_FAULTS)
    _FAULTS.clear()
    _FAULTS.update(_parse(spec))
    try:
        yield
    finally:
        _FAULTS.clear()
        _FAULTS.update(before)


def hit(point: str) -> None:
    """Pass fault point ``point``; dies or raises there if SCD_FAULT says so."""
    fault = _FAULTS.get(point)
    if fault is None:
        return
    fault[0] = int(fault[0]) - 1
    if fault[0] != 0:
        return
    if fault[1] == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (SCD_FAULT at {point})")
    sys.stderr.write(f"scd: SCD_FAULT: exiting at {point}\n")
    sys.stderr.flush()
    os._exit(137)
