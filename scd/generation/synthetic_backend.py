"""A load-testing stand-in for a GPU engine: no model, completions at a set token rate.

``generation.backend = "synthetic"`` produces complete groups of random tokens
(drawn from each prompt's own token ids, so any policy can train on them) whose
lengths are uniform in ``[min_completion_tokens, max_completion_tokens]`` (or, with
``length_from = "answer"``, each its prompt's answer's tokens), at most
``generation.max_new_tokens``; one shorter than that ends as if at EOS (it has no text,
so ``generation.stop`` does not apply), at
``tokens_per_s`` for the whole engine: one call after another (``scheduling =
"queue"``), or up to ``max_concurrent_batches`` calls at once, each at its share
of the rate, as in a continuous-batching engine (``"slots"``: a short request
started beside a long one finishes first).  A batch's sequences decode in lockstep,
as in a continuous-batching engine, so siblings finish one by one, shortest
first, and each is reported as it finishes.  Benchmarks use it to ask what the
controller costs an engine much faster than CPU training: any time the engine
has no request to work on shows up as lost tokens.  Its rollouts teach the
policy nothing.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
import torch

from scd.config import Config
from scd.generation.base import BusyClock, EngineActivity, GroupRequest, GroupResult, SiblingSink
from scd.model.policy import Policy
from scd.model.prompts import render_task
from scd.records import Completion, FinishReason, PartialSibling, Prefix
from scd.telemetry import metrics


@dataclass(slots=True)
class _Sequence:
    request: GroupRequest
    index: int
    completion: Completion  # the whole of it, drawn up front; tokens past the prefix are revealed over time
    prefix: Prefix | None

    @property
    def resumed_from(self) -> int:
        return len(self.prefix.token_ids) if self.prefix else 0

    @property
    def new_tokens(self) -> int:
        return len(self.completion.token_ids) - self.resumed_from


@dataclass(slots=True)
class _Batch:
    """One call's sequences, shortest first, decoded in lockstep from ``start``: while k of them are
    active, each token step costs k / ``rate`` seconds."""

    version: int
    start: float
    rate: float
    sequences: list[_Sequence]

    def finish_times(self) -> list[float]:
        times, at, decoded, active = [], self.start, 0, len(self.sequences)
        for q in self.sequences:
            at += (q.new_tokens - decoded) * active / self.rate
            decoded, active = q.new_tokens, active - 1
            times.append(at)
        return times

    def decoded(self, now: float) -> int:
        """New tokens each unfinished sequence has at ``now``."""
        at, decoded, active = self.start, 0, len(self.sequences)
        for q, end in zip(self.sequences, self.finish_times(), strict=True):
            if now < end:
                return decoded + max(0, int((now - at) * self.rate / active))
            at, decoded, active = end, q.new_tokens, active - 1
        return decoded

    def decoded_tokens(self, now: float) -> int:
        """New tokens decoded so far over every sequence."""
        decoded = self.decoded(now)
        return sum(min(q.new_tokens, decoded) for q in self.sequences)


class SyntheticBackend:
    # It resumes a sibling from a restored prefix and reports its part-way ones at a cut.
    resumable = True

    def __init__(self, config: Config, answer_tokens: Sequence[int] = ()) -> None:
        synthetic = config.generation.synthetic
        self.batch_groups = synthetic.batch_groups
        self.max_concurrent_batches = synthetic.max_concurrent_batches
        self._rate = synthetic.tokens_per_s
        self._lengths = (synthetic.min_completion_tokens, synthetic.max_completion_tokens)
        self._answer_tokens = answer_tokens  # by prompt id, for length_from = "answer"
        self._slots = synthetic.scheduling == "slots"
        self._logprob = -math.log(max(2, synthetic.max_completion_tokens))
        self._rng = random.Random(config.run.seed + 1)
        self._version = 0
        self._done_tokens = 0
        # The batches the engine holds; queued, it works through its calls one at a time.
        self._busy_until = 0.0
        self._in_progress: list[_Batch] = []
        self._busy = BusyClock()

    @classmethod
    async def open(cls, config: Config, policy: Policy) -> SyntheticBackend:
        # No model: ``policy`` only tokenizes the answers that set lengths.
        if config.generation.synthetic.length_from == "range":
            return cls(config)
        return cls(config, await anyio.to_thread.run_sync(_answer_tokens, config, policy))

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        version = self._version
        sequences: list[_Sequence] = []
        for req in requests:
            body = req.prompt_ids[1:] or req.prompt_ids
            for index in req.siblings:
                # Validation holds the range within the budget; an answer may be longer.
                n = min(self._answer_tokens[req.prompt_id], req.max_tokens) if self._answer_tokens \
                    else self._rng.randint(*self._lengths)
                prefix = req.prefix_of(index)
                done = len(prefix.token_ids) if prefix else 0
                new = max(n, done + 1) - done  # a resumed sibling had not finished: at least one more token
                tokens, logprobs = [self._rng.choice(body) for _ in range(new)], [self._logprob] * new
                # It has no text: a completion shorter than its budget stands for one that ended at EOS.
                finish = FinishReason.LENGTH if done + new == req.max_tokens else FinishReason.EOS
                completion = prefix.continued(tokens, logprobs, finish) if prefix else Completion(
                    tokens, logprobs, finish, version)
                sequences.append(_Sequence(req, index, completion, prefix))
        sequences.sort(key=lambda q: q.new_tokens)
        tokens = sum(q.new_tokens for q in sequences)
        now = time.monotonic()
        if self._slots:
            rate, start = self._rate / self.max_concurrent_batches, now
        else:
            rate, start = self._rate, max(now, self._busy_until)
            self._busy_until = start + tokens / rate
        batch = _Batch(version, start, rate, sequences)
        self._in_progress.append(batch)
        try:
            # A call queued behind another is in flight too: the engine works without a gap between them.
            with self._busy.request():
                for sequence, at in zip(sequences, batch.finish_times(), strict=True):
                    await anyio.sleep(max(0.0, at - time.monotonic()))
                    on_sibling(sequence.request, sequence.index, sequence.completion)
        finally:
            self._in_progress.remove(batch)
        self._done_tokens += tokens
        return [GroupResult(req, [q.completion for q in sorted(sequences, key=lambda q: q.index)
                                  if q.request is req], end_weight_version=version)
                for req in requests]

    def partial_siblings(self) -> list[PartialSibling]:
        now = time.monotonic()
        partials = []
        for batch in self._in_progress:
            decoded = batch.decoded(now)
            for q in batch.sequences:
                if q.new_tokens <= decoded:
                    continue  # finished: reported through on_sibling
                have = q.resumed_from + decoded
                if have:
                    runs = q.prefix.version_runs if q.prefix else ()
                    if decoded and (not runs or runs[-1][1] != batch.version):
                        runs = (*runs, (q.resumed_from, batch.version))
                    partials.append(PartialSibling(q.request.group_id, q.index, Prefix(
                        tuple(q.completion.token_ids[:have]), tuple(q.completion.logprobs[:have]), runs)))
        return partials

    def engine_activity(self) -> list[EngineActivity]:
        # Tokens finished, plus those the batches in progress have decoded: a real engine streams
        # tokens, so its count moves during a batch as it would there.
        now = time.monotonic()
        decoded = self._done_tokens + sum(batch.decoded_tokens(now) for batch in self._in_progress)
        return [self._busy.activity("0", decoded)]

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version
        metrics.weight_sync.labels("none").observe(0.0)  # no model: a new version is live at once

    async def abort_older_than(self, version: int) -> int:
        return 0

    async def aclose(self) -> None:
        return None


def _answer_tokens(config: Config, policy: Policy) -> list[int]:
    """Each prompt's answer's tokens, by prompt id (a non-text answer: the whole budget); blocking."""
    return [len(policy.encode_answer(p.prompt.answer)) if isinstance(p.prompt.answer, str)
            else config.generation.max_new_tokens for p in render_task(config, policy).prompts]
