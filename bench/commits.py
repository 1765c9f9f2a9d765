"""A controller driven by hand: made-up groups through its real commit path, one checkpoint now, a partition emptied.

No backend and no pumps: a benchmark that measures the commit path or a checkpoint fills the buffer itself.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import torch

from bench.configs import tiny
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.generation.base import GroupResult
from scd.records import Completion, FinishReason
from scd.rewards import Scored
from scd.schema import Trigger

# Made-up groups skip the scoring stage: each sibling scores 0.
ZERO_SCORES = {index: Scored(0.0, {}) for index in range(64)}


async def clear(partition: str) -> None:
    await DataPlane(tiny(Path("/tmp"), partition).data_plane).clear_all()


@functools.cache
def _completions(group_size: int, length: int) -> list[Completion]:
    return [Completion(torch.randint(4, 50, (length,)).tolist(), torch.rand(length).tolist(), FinishReason.LENGTH, 0)
            for _ in range(group_size)]


def fake_group(request: Any, tokens: int) -> GroupResult:
    """A group of ``tokens``-long rows (prompt included), as a backend would return it."""
    completions = _completions(len(request.siblings), tokens - len(request.prompt_ids))
    return GroupResult(request, completions, end_weight_version=0)


async def fill(controller: Controller, groups: int, tokens: int) -> int:
    """Commit ``groups`` groups through the controller's real commit path; returns payload bytes."""
    payload = 0
    for _ in range(groups):
        result = fake_group(await controller.rollouts.admit(), tokens)
        # int64 input_ids and float32 logprobs per row, as they land in TQ.
        payload += sum(8 * (len(result.request.prompt_ids) + len(c.token_ids)) + 4 * len(c.token_ids)
                       for c in result.completions)
        await controller.rollouts.commit(result, ZERO_SCORES)
    return payload


async def checkpoint_now(controller: Controller) -> None:
    """One checkpoint at the current step, written before this returns (the writer runs only for it)."""
    assert controller.checkpointer is not None
    async with anyio.create_task_group() as tg:
        await tg.start(controller.checkpointer.run_writer)
        await controller.checkpointer.attempt(Trigger.SIGNAL, wait=True)
        tg.cancel_scope.cancel()
