"""The checkpoint barrier: a writer-preferring shared/exclusive lock on anyio primitives.

Mutations of TQ, the replay index or the ledger hold it shared, tagged with a
``MutationKind``; a checkpoint holds it exclusive.  Invariants enforced here:

* no mutation runs while the exclusive side is held (one cut);
* a queued checkpoint blocks new mutations, so writers are not starved;
* the shared side is re-entrant per task, so a mutation that nests another
  (an eviction inside a commit) never waits behind a queued checkpoint;
* a cancelled waiter leaves the counters as they were.

State lives in plain counters (one event loop, no awaits between check and
update) and waiters sleep on an ``anyio.Event`` that is replaced on every
change; releasing never awaits, so it is safe inside a cancelled scope.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio


class MutationKind(enum.StrEnum):
    ADMIT = "admit"
    COMMIT = "commit"
    CONSUME = "consume"
    EVICT = "evict"
    REDISPATCH = "redispatch"
    STAGE = "stage"  # a finished sibling staged in TQ, or a stale staged one dropped
    RESCORE = "rescore"  # a ready group's rewards scored again (a restore under a changed reward set)


@dataclass(frozen=True, slots=True)
class BarrierStatistics:
    shared_active: int
    exclusive_active: bool
    exclusive_waiting: int
    mutations: dict[str, int] = field(default_factory=dict)
    blocked: dict[str, int] = field(default_factory=dict)
    max_wait_seconds: dict[str, float] = field(default_factory=dict)  # the longest single wait, per kind


@dataclass(slots=True)
class ExclusiveHold:
    """One exclusive hold; on release, how long the first mutation it blocked had waited (0 if none)."""

    mutations_blocked_s: float = 0.0


class CheckpointBarrier:
    def __init__(self, on_blocked: Callable[[MutationKind, float], None] | None = None) -> None:
        self._holders: dict[int, int] = {}  # task id -> shared depth
        self._exclusive = False
        self._exclusive_waiting = 0
        self._changed = anyio.Event()
        self._sleepers = 0
        self._mutations: Counter[str] = Counter()
        self._blocked: Counter[str] = Counter()
        self._max_wait_seconds: dict[str, float] = {}
        self._blocked_since: float | None = None  # when the first mutation blocked by this checkpoint began to wait
        self._on_blocked = on_blocked

    def _notify(self) -> None:
        # Only a sleeper needs waking; skipping the Event swap keeps the uncontended path cheap.
        if self._sleepers:
            self._changed.set()
            self._changed = anyio.Event()

    async def _sleep_until_changed(self) -> None:
        self._sleepers += 1
        try:
            await self._changed.wait()
        finally:
            self._sleepers -= 1

    def statistics(self) -> BarrierStatistics:
        return BarrierStatistics(
            shared_active=len(self._holders), exclusive_active=self._exclusive,
            exclusive_waiting=self._exclusive_waiting, mutations=dict(self._mutations),
            blocked=dict(self._blocked), max_wait_seconds=dict(self._max_wait_seconds),
        )

    @asynccontextmanager
    async def mutation(self, kind: MutationKind) -> AsyncIterator[None]:
        """Hold the shared side for one mutation of ``kind``."""
        if not isinstance(kind, MutationKind):
            raise TypeError(f"mutation kind must be a MutationKind, got {kind!r}")
        task = anyio.get_current_task().id
        self._mutations[kind.value] += 1
        if task in self._holders:
            self._holders[task] += 1
            try:
                yield
            finally:
                self._holders[task] -= 1
            return
        started = time.monotonic()
        blocked = False
        while self._exclusive or self._exclusive_waiting:
            if not blocked and self._blocked_since is None:
                self._blocked_since = started
            blocked = True
            await self._sleep_until_changed()
        if blocked:
            waited = time.monotonic() - started
            self._blocked[kind.value] += 1
            self._max_wait_seconds[kind.value] = max(waited, self._max_wait_seconds.get(kind.value, 0.0))
            if self._on_blocked:
                self._on_blocked(kind, waited)
        self._holders[task] = 1
        try:
            yield
        finally:
            del self._holders[task]
            self._notify()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[ExclusiveHold]:
        """Hold the exclusive side: new mutations wait, active ones finish first."""
        self._exclusive_waiting += 1
        try:
            while self._exclusive or self._holders:
                await self._sleep_until_changed()
        finally:
            self._exclusive_waiting -= 1
            # A cancelled checkpoint must release the mutations queued behind it.
            self._notify()
        self._exclusive = True
        hold = ExclusiveHold()
        try:
            yield hold
        finally:
            self._exclusive = False
            if self._blocked_since is not None:
                hold.mutations_blocked_s = time.monotonic() - self._blocked_since
                self._blocked_since = None
            self._notify()
