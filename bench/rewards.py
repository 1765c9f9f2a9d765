"""Rewards beside training.

``python -m bench.run reward_loop_stall``: configs/tiny.toml trains on the torch backend (generation and
training in this process) while a scorer scores groups without pause with two sync rewards at their worst:
a CPU-bound Python function and a regex that backtracks catastrophically (C code holding the interpreter
lock).  Both run in the scorer's worker processes (``task.reward_workers``, "auto"); a probe measures how
late the loop wakes.

``python -m bench.run reward_stage``: the scoring stage itself.  Its throughput through an HTTP reward on
loopback that answers each request after 1 ms, at 16 requests in flight, fed one sibling at a time as a run
hands them in as they finish (``reward_http_groups_per_s``, with the completions each request carried); and
the loop's lateness while configs/tiny.toml trains with a CPU-heavy custom reward as its only reward, every
completion scored by the stage (``reward_stage_loop_stall_p99_ms``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import orjson
from aiohttp import web

from bench.commits import clear
from bench.configs import tiny
from bench.summary import percentile, probe_loop
from scd.config import parse_config
from scd.daemon import Controller
from scd.model.policy import build_policy
from scd.model.prompts import render_task
from scd.records import Completion, FinishReason
from scd.rewards import RewardInput, Scored, load_rewards
from scd.scoring import ScoringStage, SiblingToScore

GOALS = {"reward_loop_stall_p99_ms": ("<=", 50.0), "reward_http_groups_per_s": (">=", 1000.0),
         "reward_stage_loop_stall_p99_ms": ("<=", 50.0)}

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
    group = [RewardInput(prompt_id=i, prompt="p", completion=COMPLETION, answer="", row={}, where=f"bench prompt {i}")
             for i in range(GROUP_SIZE)]
    await clear(config.data_plane.partition)
    stalls: list[float] = []
    scored = [0]


    async def score_without_pause() -> None:
        while True:
            await scorer.score(group)
            scored[0] += len(group)

    async with contextlib.aclosing(load_rewards(task, directory)) as scorer, Controller.open(config) as controller:
        await controller.run(max_steps=10)
        await scorer.score(group)  # the workers' start-up is not what is measured
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe_loop, stalls)
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


# ---- the scoring stage -------------------------------------------------------------------------

HTTP_GROUPS = 2000
HTTP_DELAY_S = 0.001
# About 20 ms of Python per completion: CPU-heavy, yet a step's 128 completions score in seconds.
HEAVY = """
def heavy(prompt, completion, answer, row):
    total = 0
    for i in range(400_000):
        total += i * i
    return float(completion == answer) + 0.0 * total
"""


@contextlib.asynccontextmanager
async def loopback_scorer(requests: list[int]) -> AsyncIterator[str]:
    """A remote scorer on 127.0.0.1 answering each request after ``HTTP_DELAY_S``, each request's item count
    appended to ``requests``; yields its URL."""

    async def score(request: web.Request) -> web.Response:
        items = orjson.loads(await request.read())["items"]
        requests.append(len(items))
        await anyio.sleep(HTTP_DELAY_S)
        return web.Response(body=orjson.dumps({"rewards": [len(i["completion"]) / 10 for i in items]}),
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/score"
    finally:
        await runner.cleanup()


async def http_groups_per_s(tmp: Path) -> dict[str, float]:
    """Groups of 8 scored per second by the stage through the loopback HTTP reward (16 requests in flight),
    each sibling handed in alone, the loop let run between two (as the generation pump hands them in)."""
    config = tiny(tmp / "http")
    policy = build_policy(config.model, config.run.seed)
    prompts = render_task(config, policy).prompts
    group_size = config.generation.group_size
    done = anyio.Event()
    scored_siblings: dict[str, int] = {}
    complete = 0

    def on_scored(sibling: SiblingToScore, scored: Scored) -> None:
        nonlocal complete
        scored_siblings[sibling.group_id] = scored_siblings.get(sibling.group_id, 0) + 1
        if scored_siblings[sibling.group_id] == group_size:
            complete += 1
            if complete == HTTP_GROUPS:
                done.set()

    requests: list[int] = []
    async with loopback_scorer(requests) as url:
        task = parse_config({"task": {"rewards": [{"function": "http", "args": {"url": url, "max_concurrency": 16}}]}},
                            tmp).task
        async with contextlib.aclosing(load_rewards(task, tmp)) as scorer, anyio.create_task_group() as tg:
            stage = ScoringStage(scorer, prompts, policy.decode, on_scored)
            await tg.start(stage.run, [])
            completion = Completion([5, 6, 7, 8], [-0.5] * 4, FinishReason.LENGTH, 0)
            started = time.monotonic()
            for g in range(HTTP_GROUPS):
                for index in range(group_size):
                    stage.submit(SiblingToScore(f"g{g}", g % len(prompts), index, completion))
                    await anyio.sleep(0)
            await done.wait()
            elapsed = time.monotonic() - started
            tg.cancel_scope.cancel()
    return {"reward_http_groups_per_s": HTTP_GROUPS / elapsed, "reward_http_siblings_per_s":
            HTTP_GROUPS * group_size / elapsed, "reward_http_requests": len(requests),
            "reward_http_completions_per_request": sum(requests) / len(requests)}


async def stage_loop_stall(tmp: Path, steps: int = 20) -> dict[str, float]:
    """Loop lateness (a 10 ms probe) over ``steps`` trainer steps after a 3-step warm-up, configs/tiny.toml
    scoring every completion with ``HEAVY`` through the scoring stage."""
    directory = tmp / "stage"
    directory.mkdir()
    (directory / "bench_heavy_reward.py").write_text(HEAVY)
    config = tiny(directory / "run", task={"rewards": [{"function": "bench_heavy_reward:heavy"}]})
    await clear(config.data_plane.partition)
    stalls: list[float] = []


    async with Controller.open(config, config_dir=directory) as controller:
        await controller.run(max_steps=3)
        scored_before = controller.rollouts.scoring.statistics().scored
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe_loop, stalls)
            await controller.run(max_steps=3 + steps)
            tg.cancel_scope.cancel()
        elapsed = time.monotonic() - started
        scored = controller.rollouts.scoring.statistics().scored - scored_before
    await clear(config.data_plane.partition)
    return {
        "reward_stage_loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
        "reward_stage_loop_stall_p50_ms": 1000 * statistics.median(stalls),
        "reward_stage_loop_stall_max_ms": 1000 * max(stalls),
        "reward_stage_completions_scored_per_s": scored / elapsed,
        "reward_stage_steps_per_s": steps / elapsed,
    }


async def stage(tmp: Path) -> dict[str, float]:
    return await http_groups_per_s(tmp) | await stage_loop_stall(tmp)
