"""A load-testing stand-in for a GPU engine: no model, completions at a set token rate.

``generation.backend = "synthetic"`` produces complete groups of random tokens
(drawn from each prompt's own token ids, so any policy can train on them) whose
lengths are uniform in ``[min_completion_tokens, max_completion_tokens]`` (or, with
``length_from = "answer"``, each its prompt's completion budget), at
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

import anyio
import torch

from scd.config import Config
from scd.generation.base import BusyClock, EngineActivity, GroupRequest, GroupResult, SiblingSink
from scd.records import Completion, FinishReason
from scd.telemetry import metrics


class SyntheticBackend:
    def __init__(self, config: Config) -> None:
        synthetic = config.generation.synthetic
        self.batch_groups = synthetic.batch_groups
        self.max_concurrent_batches = synthetic.max_concurrent_batches
        self._rate = synthetic.tokens_per_s
        self._lengths = (synthetic.min_completion_tokens, synthetic.max_completion_tokens)
        self._length_from_answer = synthetic.length_from == "answer"
        self._slots = synthetic.scheduling == "slots"
        self._logprob = -math.log(max(2, synthetic.max_completion_tokens))
        self._rng = random.Random(config.run.seed + 1)
        self._version = 0
        self._done_tokens = 0
        # (start, end, tokens) of the work the engine holds; queued, it works through its calls one at a time.
        self._busy_until = 0.0
        self._in_progress: list[tuple[float, float, int]] = []
        self._busy = BusyClock()

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        version = self._version
        sequences: list[tuple[GroupRequest, int, Completion]] = []
        for req in requests:
            body = req.prompt_ids[1:] or req.prompt_ids
            for index in req.siblings:
                n = req.max_tokens if self._length_from_answer else self._rng.randint(*self._lengths)
                sequences.append((req, index, Completion(
                    token_ids=[self._rng.choice(body) for _ in range(n)], logprobs=[self._logprob] * n,
                    finish_reason=FinishReason.LENGTH, weight_version=version,
                )))
        tokens = sum(len(c.token_ids) for _, _, c in sequences)
        now = time.monotonic()
        if self._slots:
            rate, start = self._rate / self.max_concurrent_batches, now
        else:
            rate, start = self._rate, max(now, self._busy_until)
            self._busy_until = start + tokens / rate
        work = (start, start + tokens / rate, tokens)
        self._in_progress.append(work)
        # Lockstep decoding: while k sequences are active, each token step costs k / rate seconds.
        at, decoded, active = start, 0, len(sequences)
        try:
            # A call queued behind another is in flight too: the engine works without a gap between them.
            with self._busy.request():
                for req, index, completion in sorted(sequences, key=lambda s: len(s[2].token_ids)):
                    at += (len(completion.token_ids) - decoded) * active / rate
                    decoded, active = len(completion.token_ids), active - 1
                    await anyio.sleep(max(0.0, at - time.monotonic()))
                    on_sibling(req, index, completion)
        finally:
            self._in_progress.remove(work)
        self._done_tokens += tokens
        metrics.generation_tokens.inc(tokens)
        return [GroupResult(req, [c for r, _, c in sequences if r is req], end_weight_version=version)
                for req in requests]

    def generated_tokens(self) -> int:
        """Tokens finished, plus the share of queued work the engine has got through: a real engine
        streams tokens, so the counter moves during a batch as it would there."""
        now = time.monotonic()
        partial = sum(n * min(1.0, max(0.0, (now - start) / (end - start)))
                      for start, end, n in self._in_progress if end > start)
        return self._done_tokens + int(partial)

    def engine_activity(self) -> list[EngineActivity]:
        return [self._busy.activity("0", self.generated_tokens())]

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version
        metrics.weight_sync.labels("none").observe(0.0)  # no model: a new version is live at once

    async def abort_older_than(self, version: int) -> int:
        return 0

    async def aclose(self) -> None:
        return None
