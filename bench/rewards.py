"""The event loop while rewards score beside training: ``python -m bench.run reward_loop_stall``.

configs/tiny.toml trains on the torch backend (generation and training in this process) while a scorer
scores groups without pause with two sync rewards at their worst: a CPU-bound Python function and a
regex that backtracks catastrophically (C code holding the interpreter lock).  Both run in the scorer's
worker processes (``task.reward_workers``, "auto"); a probe measures how late the loop wakes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import anyio

from bench.commits import clear
from bench.configs import tiny
from bench.summary import percentile
from scd.config import parse_config
from scd.daemon import Controller
from scd.rewards import RewardInput, load_rewards

GOALS = {"reward_loop_stall_p99_ms": ("<=", 50.0)}

BUSY = """
def busy(prompt, completion, answer, row):
    total = 0
    for i in range(2_000_000):
        total += i * i
    return float(total > 0)
"""
# Each further "a" before the "!" doubles the regex's time: 22 take ~0.15 s on a 2-core box.
COMPLETION = "a" * 22 + "!"
GROUP_SIZE = 8


async def loop_stall(tmp: Path, steps: int = 150) -> dict[str, float]:
    """Loop lateness (a 10 ms probe) over ``steps`` trainer steps after a 10-step warm-up, scoring beside."""
    directory = tmp / "rewards"
    directory.mkdir()
    (directory / "bench_busy_reward.py").write_text(BUSY)
    task = parse_config({"task": {"rewards": [
        {"function": "bench_busy_reward:busy"},
        {"function": "regex", "name": "backtracking", "args": {"pattern": r"^(a+)+$"}},
    ]}}, directory).task
    config = tiny(directory / "run")
    group = [RewardInput(prompt_id=i, prompt="p", completion=COMPLETION, answer="", row={}) for i in range(GROUP_SIZE)]
    await clear(config.data_plane.partition)
    stalls: list[float] = []
    scored = [0]

    async def loop_probe() -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            stalls.append(time.monotonic() - before - 0.01)

    async def score_without_pause() -> None:
        while True:
            await scorer.score(group)
            scored[0] += len(group)

    async with contextlib.aclosing(load_rewards(task, directory)) as scorer, Controller.open(config) as controller:
        await controller.run(max_steps=10)
        await scorer.score(group)  # the workers' start-up is not what is measured
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop_probe)
            tg.start_soon(score_without_pause)
            await controller.run(max_steps=10 + steps)
            tg.cancel_scope.cancel()
        elapsed = time.monotonic() - started
    await clear(config.data_plane.partition)
    return {
        "reward_loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
        "reward_loop_stall_p50_ms": 1000 * statistics.median(stalls),
        "reward_loop_stall_max_ms": 1000 * max(stalls),
        "reward_completions_scored_per_s": scored[0] / elapsed,
        "reward_steps_per_s": steps / elapsed,
        "reward_workers": task.reward_worker_count(),
    }
