"""The scoring stage: between generation and commit, every finished sibling is scored once.

A sibling is handed in as it finishes (``submit``), beside its staging, so an expensive reward (an LLM judge,
a sandbox) runs while the rest of its group still generates.  The stage batches across arrivals (what is
queued, and what arrives within ``SCORE_LINGER_S`` of a batch's first sibling; the scorer's rewards batch
again, an HTTP one per request), decodes the completions off the loop, and reports
each ``Scored`` back through ``on_scored``; ``scd.rollouts`` keeps the score with its sibling, in memory and in
a checkpoint's cut, and commits a group once every sibling is scored.  So no sibling is scored twice, not
even across a restore, and a restore never regenerates one whose score was still owed.

When a reward's service is down (``RewardUnavailable``: an HTTP reward's, or a Python reward's own) the
batch waits and is asked again, with a backoff, for as long as it takes (``scores_when_available``, which an
eval waits through too), each time only for what did not answer, so every other reward is paid once per
sibling: finished siblings wait (staged) with their tokens, admission stops at the staleness window (groups
awaiting their scores hold their place in flight), ``/readyz`` says why (``/healthz`` stays ok: the process is
alive, waiting), and nothing is regenerated.  A reward that fails on a completion (``RewardError``) ends the
run, unless ``task.reward_errors = "zero"``.

The stage never reaches up: it knows the scorer, the prompts and how to decode, nothing of the rollouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from scd.model.prompts import RenderedPrompt
from scd.records import Completion
from scd.rewards import Answers, RewardInput, RewardUnavailable, Scored, Scorer
from scd.telemetry import metrics

SCORE_BATCH_MAX = 256  # siblings handed to the scorer at once
SCORE_BATCHES_IN_FLIGHT = 16  # batches scored at once (an HTTP reward keeps its own request limit)
# How long a batch waits after its first sibling for the next ones to join it: milliseconds against a group's
# seconds of generation, and an HTTP reward fed one sibling at a time sends full requests, not one per sibling.
SCORE_LINGER_S = 0.01
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

    def submit(self, sibling: SiblingToScore) -> None:
        """Queue a finished sibling to be scored.  While the stage does not run (between runs) it is not
        queued: the next run's ``run`` is handed every sibling still owed a score."""
        if self._to_score is not None:
            self._queued += 1
            self._to_score.send_nowait(sibling)

    def resumed(self, step: int, reward_changes: Collection[str]) -> list[str]:
        """The run restored a bundle of ``step``: past step 0 its rewards have answered before (groups were
        trained), so a service down at this start is waited for, never refused as one that never answered;
        but for one whose URL the restore changed (``reward_changes``: the changed settings' keys).  Returns
        the names of the rewards taken as answered before."""
        return self._scorer.answered_before(reward_changes) if step > 0 else []

    def statistics(self) -> ScoringStatistics:
        outage = self._scorer.outage()
        return ScoringStatistics(scored=self._scored, queued=self._queued, scoring=self._scoring,
                                 unavailable=outage.why, unavailable_s=outage.seconds)

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
                    # A free slot first, then the batch: while every slot is busy, siblings arriving queue up
                    # and go together in the next batch.
                    await slots.acquire()
                    batch = await _next_batch(queue)
                    self._queued -= len(batch)
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
            scores = await scores_when_available(self._scorer, inputs)
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
        return RewardInput.of(self._prompts[sibling.prompt_id].prompt, completion)


async def scores_when_available(scorer: Scorer, inputs: Sequence[RewardInput], *, observe: bool = True) -> list[Scored]:
    """``inputs``' scores, asked again with a backoff while a reward's service does not answer: the one place
    an outage is waited out (the stage's batches and an eval's), nothing dropped or regenerated meanwhile.
    Each retry hands back what answered, so it asks only what did not: no reward is paid twice for an input."""
    wait_s = UNAVAILABLE_RETRY_FIRST_S
    answers: Answers | None = None
    while True:
        try:
            return await scorer.score(inputs, observe=observe, answers=answers)
        except RewardUnavailable as exc:
            answers = exc.answers
            await anyio.sleep(wait_s)
            wait_s = min(2 * wait_s, UNAVAILABLE_RETRY_LONGEST_S)


async def _next_batch(queue: MemoryObjectReceiveStream[SiblingToScore]) -> list[SiblingToScore]:
    """The next sibling queued, waiting for it, and every one queued behind it or arriving within
    ``SCORE_LINGER_S`` after it, up to ``SCORE_BATCH_MAX``: siblings arrive one at a time as they finish, and
    one request for many is what lets an HTTP reward keep up."""
    batch = [await queue.receive()]
    _take_queued(queue, batch)
    if len(batch) < SCORE_BATCH_MAX:
        await anyio.sleep(SCORE_LINGER_S)  # a sleep, not a receive with a deadline: a cancelled receive loses its item
        _take_queued(queue, batch)
    return batch


def _take_queued(queue: MemoryObjectReceiveStream[SiblingToScore], batch: list[SiblingToScore]) -> None:
    while len(batch) < SCORE_BATCH_MAX:
        try:
            batch.append(queue.receive_nowait())
        except anyio.WouldBlock:
            return
