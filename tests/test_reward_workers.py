"""The sync rewards' worker processes (``scd.rewards.pool``) when one dies: idle, it is replaced and no completion
pays for it; under a call, the call gets one fresh worker, and only a reward that kills that one too fails."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from scd.config import auto_reward_workers
from scd.rewards import load_rewards
from tests.test_rewards import alive, item, task_config, write_module

# A reward whose value is the pid of the worker that ran it; "dies_once" kills its worker the first time it
# sees a completion (a marker file beside the module remembers it), as the OOM killer might mid-call.
WORKERS = """
import os
from pathlib import Path

def pid(prompt, completion, answer, row):
    return float(os.getpid())

def dies_once(prompt, completion, answer, row):
    marker = Path(__file__).with_name(completion)
    if not marker.exists():
        marker.touch()
        os._exit(9)
    return float(os.getpid())
"""


def wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"worker {pid} still alive"
        time.sleep(0.01)


async def test_an_idle_worker_that_died_is_replaced_and_no_completion_pays_for_it(tmp_path: Path) -> None:
    name = write_module(tmp_path, WORKERS)
    config = task_config({"function": f"{name}:pid", "name": "pid"}, reward_workers=1)
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        [first] = await scorer.score([item("x")])
        os.kill(int(first.total), signal.SIGKILL)
        wait_dead(int(first.total))
        [second] = await scorer.score([item("x")])
        stats = scorer.statistics()
    assert second.total != first.total  # a fresh worker scored it
    assert (stats.errors, stats.pool.replaced, stats.pool.retried, stats.pool.killed, stats.pool.workers) == \
        (0, 1, 0, 0, 1)


async def test_a_worker_that_dies_under_a_call_gets_the_call_retried_once_on_a_fresh_one(tmp_path: Path) -> None:
    name = write_module(tmp_path, WORKERS)
    config = task_config({"function": f"{name}:dies_once", "name": "dies_once"}, reward_workers=2)
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        results = await scorer.score([item("a"), item("b")])
        stats = scorer.statistics()
    assert all(result.total > 0 for result in results)  # each pid: scored on the second worker it met
    assert (stats.errors, stats.pool.retried, stats.pool.replaced, stats.pool.workers) == (0, 2, 0, 2)


async def test_a_value_json_cannot_hold_fails_its_call_before_any_worker_is_taken(tmp_path: Path) -> None:
    # Dataset rows arrive JSON-safe (scd.tasks); a value that still is not fails the caller, no worker.
    config = task_config({"function": "exact"}, reward_workers=1)
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        with pytest.raises(ExceptionGroup) as caught:  # the scorer's task group
            await scorer.score([item("x", row={"price": Decimal("0.5")})])
        assert caught.group_contains(orjson.JSONEncodeError, match="Decimal")
        [scored] = await scorer.score([item("x", "x")])
        stats = scorer.statistics()
    assert scored.total == 1.0
    assert (stats.pool.killed, stats.pool.workers) == (0, 1)


def test_auto_reward_workers_leave_a_core_to_the_loop_and_stop_at_eight() -> None:
    # Each worker holds ~285 MiB and takes ~5 s to start: cores - 1 on a 192-vCPU node was ~53 GiB.
    assert [auto_reward_workers(cores) for cores in (1, 2, 4, 9, 16, 192)] == [1, 1, 3, 8, 8, 8]
    assert task_config().reward_worker_count() == auto_reward_workers(len(os.sched_getaffinity(0)))
    assert task_config(reward_workers=12).reward_worker_count() == 12
