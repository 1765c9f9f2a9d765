"""The worker processes that run sync rewards, the built-ins included (``scd.rewards.worker``).

Why processes and not threads: a sync reward's Python holds the interpreter lock beside the event loop,
and one in C code (a regex backtracking) holds it for the whole call, so on a thread it stalls the loop
however few threads there are; and a thread cannot be stopped, so a hung call kept its thread for good.
A worker process is killed when its call runs past the deadline, and a fresh one takes its place.

A worker can also die of something no completion did (the OOM killer, an operator's ``kill``).  One found
dead while idle is replaced before it is handed a call; a call whose worker dies under it is run once more
on a fresh worker, and fails as ``crashed`` only if that one dies too (a reward that kills its worker).

Each call waits for a free worker first (a worker is started on demand, up to the pool's size, and its
start-up is not the call's); the deadline starts when a worker takes the call.  Calls and replies are
plain JSON lines over the worker's pipes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import scd
from scd.config import RewardConfig
from scd.rewards.functions import Failure, Outcome

# A worker imports scd, the reward modules and what they import (math-verify brings sympy): seconds on a busy box.
WORKER_START_TIMEOUT_S = 120.0
_MAX_LINE_BYTES = 64 << 20
# How long a worker that closed its pipes may take to exit before it is killed.
_EXIT_GRACE_S = 5.0
# The worker imports this very scd, wherever the parent's came from.
_SCD_ROOT = str(Path(scd.__file__).resolve().parents[1])

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    workers: int  # worker processes running (or starting)
    busy: int  # of those, running a call
    queued: int  # calls waiting for a worker
    killed: int  # workers killed because their call ran past its deadline or was cancelled
    replaced: int  # idle workers found dead (killed by something else) and replaced before a call
    retried: int  # calls run again on a fresh worker because theirs died under them


@dataclass(frozen=True, slots=True)
class PoolCall:
    reward: int  # which of the pool's rewards
    prompt: object
    completion: str
    answer: object
    row: dict[str, Any]


def _line(message: object) -> bytes:
    return orjson.dumps(message) + b"\n"


class _Worker:
    def __init__(self, process: Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._calls = process.stdin
        self._replies = BufferedByteReceiveStream(process.stdout)

    async def send(self, line: bytes) -> None:
        await self._calls.send(line)

    async def receive(self) -> dict[str, Any]:
        return orjson.loads(await self._replies.receive_until(b"\n", _MAX_LINE_BYTES))

    def exited(self) -> bool:
        """Whether the process has exited, reaped or not.

        Its state in /proc, not ``waitid(WNOWAIT)``: while asyncio's child watcher thread, blocked in ``waitpid``,
        is claiming a zombie, ``waitid`` finds nothing to wait for, and the process object knows nothing yet.
        (A pid reused after the reap reads as alive: the call then fails on it and runs again on a fresh worker.)
        """
        if self.process.returncode is not None:
            return True
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                return stat.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
        except FileNotFoundError:  # reaped
            return True

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError):  # it exited on its own
                self.process.kill()
            await self.process.aclose()

    async def reap(self) -> None:
        """Collect a worker that closed its pipes, killed if it does not exit within ``_EXIT_GRACE_S``.

        Not ``kill`` at once: killing an exited worker reaps it (``Popen.send_signal`` polls first) before
        asyncio's child watcher can, and the exit code is lost (asyncio reports 255)."""
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(_EXIT_GRACE_S):
                await self.process.wait()
            await self.kill()


@dataclass(frozen=True, slots=True)
class _DiedScoring:
    """The call's worker exited, or closed its pipes, before it answered."""

    failure: Failure


class WorkerPool:
    """Up to ``size`` worker processes, each with every one of ``rewards`` loaded; ``aclose`` when done."""

    def __init__(self, rewards: Sequence[tuple[str, RewardConfig]], base_dir: Path, size: int) -> None:
        # sys.path as it is when the rewards are resolved: a worker imports their modules as scd did.
        self._header = {"path": list(sys.path), "base_dir": str(base_dir),
                        "rewards": [{"key": key, "reward": msgspec.to_builtins(reward)} for key, reward in rewards]}
        self._free = anyio.Semaphore(size)
        self._idle: list[_Worker] = []
        self._workers = 0
        self._busy = 0
        self._queued = 0
        self._killed = 0
        self._replaced = 0
        self._retried = 0

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(workers=self._workers, busy=self._busy, queued=self._queued, killed=self._killed,
                              replaced=self._replaced, retried=self._retried)

    async def call(self, call: PoolCall, timeout_s: float) -> Outcome:
        """One reward call in a worker, killed (and later replaced) if it runs past ``timeout_s``; run once more
        on a fresh worker if its worker dies under it."""
        line = _line(call)  # before a worker is taken: a value JSON cannot hold is the caller's error, no worker's
        self._queued += 1
        try:
            await self._free.acquire()
        finally:
            self._queued -= 1
        try:
            outcome = await self._call_once(line, timeout_s)
            if isinstance(outcome, _DiedScoring):
                self._retried += 1
                log.warning("a reward call failed, %s: it runs again on a fresh worker", outcome.failure.detail)
                outcome = await self._call_once(line, timeout_s)
            return outcome.failure if isinstance(outcome, _DiedScoring) else outcome
        finally:
            self._free.release()

    async def _call_once(self, line: bytes, timeout_s: float) -> Outcome | _DiedScoring:
        worker = await self._live_idle_worker() or await self._start()
        if isinstance(worker, Failure):
            return worker
        return await self._run(worker, line, timeout_s)

    async def _live_idle_worker(self) -> _Worker | None:
        """An idle worker still alive, those found dead collected on the way (no call's fault); None when none is."""
        while self._idle:
            worker = self._idle.pop()
            if not worker.exited():
                return worker
            self._replaced += 1
            self._workers -= 1
            await worker.reap()
            log.warning("a reward worker (pid %d) died while idle (exit code %s): a fresh one takes its place",
                        worker.process.pid, worker.process.returncode)
        return None

    async def _run(self, worker: _Worker, line: bytes, timeout_s: float) -> Outcome | _DiedScoring:
        self._busy += 1
        try:
            with anyio.move_on_after(timeout_s) as deadline:
                await worker.send(line)
                reply = await worker.receive()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.IncompleteRead, anyio.EndOfStream):
            return _DiedScoring(await self._lost(worker, "exited while scoring"))
        except BaseException:  # cancelled mid-call: its answer would be read as the next call's
            await self._discard(worker, killed=True)
            raise
        finally:
            self._busy -= 1
        if deadline.cancelled_caught:
            await self._discard(worker, killed=True)
            return Failure("timeout", f"took longer than task.reward_timeout_s = {timeout_s} s")
        self._idle.append(worker)
        if "value" in reply:
            return reply["value"]
        return Failure(reply["cause"], reply["detail"])

    async def _start(self) -> _Worker | Failure:
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SCD_ROOT,
                                                                                 os.environ.get("PYTHONPATH")]))}
        process = await anyio.open_process([sys.executable, "-m", "scd.rewards.worker", str(os.getpid())],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                           env=environment)
        self._workers += 1
        worker = _Worker(process)
        try:
            with anyio.fail_after(WORKER_START_TIMEOUT_S):
                await worker.send(_line(self._header))
                started = await worker.receive()
        except TimeoutError:
            await self._discard(worker, killed=False)
            return Failure("crashed", f"a reward worker did not start within {WORKER_START_TIMEOUT_S} s")
        except (anyio.BrokenResourceError, anyio.IncompleteRead, anyio.EndOfStream):
            return await self._lost(worker, "exited while starting")
        except BaseException:
            await self._discard(worker, killed=False)
            raise
        if "error" in started:
            await self._discard(worker, killed=False)
            return Failure("crashed", f"a reward worker could not load the rewards: {started['error']}")
        return worker

    async def _lost(self, worker: _Worker, when: str) -> Failure:
        self._workers -= 1
        await worker.reap()
        return Failure("crashed", f"its worker process {when} (exit code {worker.process.returncode})")

    async def _discard(self, worker: _Worker, *, killed: bool) -> None:
        self._workers -= 1
        self._killed += killed
        await worker.kill()

    async def aclose(self) -> None:
        """Kill every idle worker (calls in flight kill their own when cancelled)."""
        idle, self._idle = self._idle, []
        for worker in idle:
            await self._discard(worker, killed=False)
