"""The scoring stage batches across arrivals: siblings handed in one at a time, as a run hands them in as they
finish, reach an HTTP reward (a real server on loopback) in requests of many, not one request each.  A count,
not a timing: bench/rewards.py measures the throughput it buys."""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio

from bench.rewards import loopback_scorer
from scd.config import parse_config
from scd.model.prompts import RenderedPrompt
from scd.records import Completion, FinishReason
from scd.rewards import load_rewards
from scd.scoring import ScoringStage, SiblingToScore
from scd.tasks import Prompt

SIBLINGS = 128
# What the HTTP reward is configured with: the most a request carries.
BATCH_SIZE = 32


async def test_siblings_arriving_one_at_a_time_reach_an_http_reward_in_requests_of_many(tmp_path: Path) -> None:
    prompts = [RenderedPrompt(Prompt(prompt_id=0, prompt="p", answer="a", where="test:0"), (1, 2), 4)]
    completion = Completion([5, 6, 7, 8], [0.0] * 4, FinishReason.LENGTH, 0)
    requests: list[int] = []
    scored: list[SiblingToScore] = []
    async with loopback_scorer(requests) as url:
        task = parse_config({"task": {"rewards": [
            {"function": "http", "args": {"url": url, "batch_size": BATCH_SIZE}}]}}, tmp_path).task
        async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
            stage = ScoringStage(scorer, prompts, lambda ids: "".join(map(str, ids)),
                                 lambda sibling, _: scored.append(sibling))
            await tg.start(stage.run, [])
            for index in range(SIBLINGS):
                stage.submit(SiblingToScore(f"g{index // 8}", 0, index % 8, completion))
                await anyio.sleep(0)  # the loop runs between two arrivals, as it does between two finished siblings
            with anyio.fail_after(60):
                while len(scored) < SIBLINGS:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert sum(requests) == SIBLINGS and max(requests) <= BATCH_SIZE
    # Before batching across arrivals: a request for every sibling or two.
    assert len(requests) <= SIBLINGS // 4, requests
