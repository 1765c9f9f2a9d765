"""The scoring stage: between generation and commit, every finished sibling is scored once.

A sibling is handed in as it finishes (``submit``), beside its staging, so an expensive reward (an LLM judge,
a sandbox) runs while the rest of its group still generates.  The stage batches what is queued (the
scorer's rewards batch again, an HTTP one per request), decodes the completions off the loop, and reports
each ``Scored`` back through ``on_scored``; ``scd.rollouts`` keeps the score with its sibling, in memory and in
a checkpoint's cut, and commits a group once every sibling is scored.  So no sibling is scored twice, not
even across a restore, and a restore never regenerates one whose score was still owed.

When an HTTP reward's service is down (``RewardUnavailable``) the batch waits and is asked again, with a
backoff, for as long as it takes: finished siblings wait (staged) with their tokens, admission stops at the
staleness window (groups awaiting their scores hold their place in flight), ``/healthz`` says why, and
nothing is regenerated.  A reward that fails on a completion (``RewardError``) ends the run, unless
``task.reward_errors = "zero"``.

The stage never reaches up: it knows the scorer, the prompts and how to decode, nothing of the rollouts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from scd.model.prompts import RenderedPrompt
from scd.records import Completion
from scd.rewards import RewardInput, RewardUnavailable, Scored, Scorer
from scd.telemetry import metrics

log = logging.getLogger(__name__)

SCORE_BATCH_MAX = 256  # siblings handed to the scorer at once
SCORE_BATCHES_IN_FLIGHT = 16  # batches scored at once (an HTTP reward keeps its own request limit)
# After an outage's first refused batch: the wait before it is asked again, doubled up to the longest.
UNAVAILABLE_RETRY_FIRST_S = 1.0
UNAVAILABLE_RETRY_LONGEST_S = 30.0


@dataclass(frozen=True, slots=True)
class SiblingToScore:
    group_id: str
    prompt_id: int
    index: int
    completion: Completion


@dataclass(frozen=True, slots=True)
class ScoringStatistics:
    scored: int  # siblings scored by this process
    queued: int  # siblings waiting for a batch
    scoring: int  # siblings in batches being scored (or waiting out an outage)
    unavailable: str  # why a reward's service does not answer now; "" when every reward does
    unavailable_s: float  # how long the current outage has lasted (0 without one)


class ScoringStage:
    def __init__(self, scorer: Scorer, prompts: Sequence[RenderedPrompt], decode: Callable[[Sequence[int]], str],
                 on_scored: Callable[[SiblingToScore, Scored], None]) -> None:
        self._scorer = scorer
        self._prompts = prompts
        self._decode = decode
        self._on_scored = on_scored
        self._to_score: MemoryObjectSendStream[SiblingToScore] | None = None
        self._queued = 0
        self._scoring = 0
        self._scored = 0
        self._unavailable = ""
        self._unavailable_since = 0.0

    def submit(self, sibling: SiblingToScore) -> None:
        """Queue a finished sibling to be scored.  While the stage does not run (between runs) it is not
        queued: the next run's ``run`` is handed every sibling still owed a score."""
        if self._to_score is not None:
            self._queued += 1
            self._to_score.send_nowait(sibling)

    def unavailable(self) -> str:
        """Why a reward's service does not answer now ("" when it does): what ``/healthz`` reports."""
        return self._unavailable

    def statistics(self) -> ScoringStatistics:
        return ScoringStatistics(
            scored=self._scored, queued=self._queued, scoring=self._scoring, unavailable=self._unavailable,
            unavailable_s=time.monotonic() - self._unavailable_since if self._unavailable else 0.0)

    async def run(self, owed: Iterable[SiblingToScore], *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Score ``owed`` (every sibling owed a score when the run starts) and what is submitted from now on,
        until cancelled; a batch cancelled part-way is owed again to the next run."""
        to_score, queue = anyio.create_memory_object_stream[SiblingToScore](math.inf)
        self._to_score = to_score
        for sibling in owed:
            self.submit(sibling)
        # Taken here, given back by the batch's task: a semaphore, since a limiter's token is its borrower's.
        slots = anyio.Semaphore(SCORE_BATCHES_IN_FLIGHT)
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                while True:
                    batch = await _next_batch(queue)
                    self._queued -= len(batch)
                    await slots.acquire()
                    tg.start_soon(self._score_batch, batch, slots, name="score_batch")
        finally:
            self._to_score = None
            self._queued = 0
            to_score.close()
            queue.close()

    async def _score_batch(self, batch: list[SiblingToScore], slots: anyio.Semaphore) -> None:
        self._scoring += len(batch)
        try:
            texts = await anyio.to_thread.run_sync(self._decoded, batch)
            inputs = [self._input(sibling, text) for sibling, text in zip(batch, texts, strict=True)]
            scores = await self._until_available(inputs)
        finally:
            self._scoring -= len(batch)
            slots.release()
        for sibling, scored in zip(batch, scores, strict=True):
            self._scored += 1
            metrics.siblings_scored.inc()
            self._on_scored(sibling, scored)

    def _decoded(self, batch: Sequence[SiblingToScore]) -> list[str]:
        return [self._decode(sibling.completion.token_ids) for sibling in batch]

    def _input(self, sibling: SiblingToScore, completion: str) -> RewardInput:
        prompt = self._prompts[sibling.prompt_id].prompt
        return RewardInput(sibling.prompt_id, prompt.prompt, completion, prompt.answer, prompt.row, prompt.where)

    async def _until_available(self, inputs: list[RewardInput]) -> list[Scored]:
        """The batch's scores, asked again while a reward's service does not answer: the one place an outage
        is waited out (nothing is dropped or regenerated meanwhile)."""
        wait_s = UNAVAILABLE_RETRY_FIRST_S
        while True:
            try:
                scores = await self._scorer.score(inputs)
            except RewardUnavailable as exc:
                self._outage(str(exc))
                await anyio.sleep(wait_s)
                wait_s = min(2 * wait_s, UNAVAILABLE_RETRY_LONGEST_S)
                continue
            self._answered()
            return scores

    def _outage(self, why: str) -> None:
        if not self._unavailable:
            self._unavailable_since = time.monotonic()
            log.warning("scoring waits: %s; finished siblings wait, staged, until it answers", why)
        self._unavailable = why
        metrics.reward_unavailable.set(1)

    def _answered(self) -> None:
        if self._unavailable:
            log.warning("scoring resumes: the reward service answers again after %.0f s",
                        time.monotonic() - self._unavailable_since)
            self._unavailable = ""
            metrics.reward_unavailable.set(0)


async def _next_batch(queue: MemoryObjectReceiveStream[SiblingToScore]) -> list[SiblingToScore]:
    """The next sibling queued, waiting for it, and every one queued behind it, up to ``SCORE_BATCH_MAX``."""
    batch = [await queue.receive()]
    while len(batch) < SCORE_BATCH_MAX:
        try:
            batch.append(queue.receive_nowait())
        except anyio.WouldBlock:
            break
    return batch
