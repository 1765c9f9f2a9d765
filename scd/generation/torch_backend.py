"""The embedded default: batched sampling from the policy's own torch model, in one worker thread."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import anyio
import torch

from scd.config import Config
from scd.generation.base import BusyClock, EngineActivity, GroupRequest, GroupResult, SiblingSink
from scd.model.policy import Policy
from scd.model.sampling import Sampling
from scd.model.weights import unaliased
from scd.records import Completion, FinishReason, PartialSibling
from scd.telemetry import metrics


class TorchBackend:
    max_concurrent_batches = 1
    # A batch samples whole sequences on one worker thread: nothing part-way to report or resume,
    # so a restore generates its siblings again (counted as dropped prefix tokens: none).
    resumable = False

    def __init__(self, config: Config, policy: Policy) -> None:
        self.batch_groups = config.generation.torch.batch_groups
        self._sampling = Sampling.of(config.generation)
        self._stop = config.generation.stop
        self._policy = policy
        self._model = policy.build_model().eval()
        self._rng = torch.Generator().manual_seed(config.run.seed + 1)
        self._version = 0
        self._tokens = 0
        self._tokens_lock = threading.Lock()
        # Busy while sampling, not while a batch waits for a weight load to finish.
        self._busy = BusyClock()
        # Sampling and weight loads take turns on the one model, so a batch never mixes versions.
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    async def open(cls, config: Config, policy: Policy) -> TorchBackend:
        # Building the model takes a while: off the event loop.
        return await anyio.to_thread.run_sync(cls, config, policy)

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        # A batch's siblings finish together: nothing to report before it returns.
        return await anyio.to_thread.run_sync(self._generate_blocking, requests, limiter=self._limiter)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        def load() -> None:
            # Tensor by tensor, in the model's order: a trainer group's weights arrive a layer at a
            # time, and none of the trainer's tensors is kept past the call.
            with torch.no_grad():
                for name, tensor in unaliased(self._model.state_dict()).items():
                    tensor.copy_(weights[name])
            self._version = version

        started = time.monotonic()
        await anyio.to_thread.run_sync(load, limiter=self._limiter)
        metrics.weight_sync.labels("in_process").observe(time.monotonic() - started)

    def partial_siblings(self) -> list[PartialSibling]:
        return []

    async def abort_older_than(self, version: int) -> int:
        # A batch runs under one version from start to end and no request waits inside the backend.
        return 0

    def engine_activity(self) -> list[EngineActivity]:
        with self._tokens_lock:
            return [self._busy.activity("0", self._tokens)]

    async def aclose(self) -> None:
        return None

    def _generate_blocking(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        with self._busy.request():
            return self._sample_groups(requests)

    @torch.no_grad()
    def _sample_groups(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        version = self._version
        # Groups whose prompt length and token budget match share one batched forward pass.
        by_shape: dict[tuple[int, int, float | None], list[GroupRequest]] = defaultdict(list)
        for req in requests:
            by_shape[(len(req.prompt_ids), req.max_tokens, req.temperature)].append(req)
        results: dict[str, GroupResult] = {}
        for (_, max_tokens, temperature), reqs in by_shape.items():
            prompts = torch.tensor([req.prompt_ids for req in reqs for _ in req.siblings], dtype=torch.int64)
            sampling = self._sampling if temperature is None else replace(self._sampling, temperature=temperature)
            sampled = iter(self._sample(prompts, max_tokens, sampling))
            for req in reqs:
                completions = [Completion(tokens, logprobs, finish, version)
                               for tokens, logprobs, finish in (next(sampled) for _ in req.siblings)]
                results[req.group_id] = GroupResult(req, completions, end_weight_version=version)
                with self._tokens_lock:
                    self._tokens += sum(len(c.token_ids) for c in completions)
        return [results[req.group_id] for req in requests]

    def _sample(self, prompts: torch.Tensor, max_tokens: int,
                sampling: Sampling) -> list[tuple[list[int], list[float], FinishReason]]:
        """Each row's completion: until EOS (kept), a stop string in its text (the token that completed it
        kept, as vLLM keeps it) or ``max_tokens``.  Rows that have ended ride along until all have."""
        rows = prompts.shape[0]
        tokens = prompts
        logprobs = torch.empty(rows, 0)
        ended: list[FinishReason | None] = [None] * rows
        lengths = [max_tokens] * rows
        head = self._policy.output_head(self._model)
        for step in range(max_tokens):
            # Only the last position is projected to the vocabulary: the one whose next token is drawn.
            logits = head(self._policy.hidden(self._model, tokens)[:, -1]).float()
            if sampling.temperature == 0:  # greedy: the likeliest token, logprob 0 under the point mass
                nxt, logp = logits.argmax(-1, keepdim=True), torch.zeros_like(logits)
            else:
                logp = sampling.logprobs(logits)
                nxt = torch.multinomial(logp.exp(), 1, generator=self._rng)
            logprobs = torch.cat([logprobs, logp.gather(-1, nxt)], dim=1)
            tokens = torch.cat([tokens, nxt], dim=1)
            for row in (r for r in range(rows) if ended[r] is None):
                reason = self._ended(tokens[row, prompts.shape[1]:].tolist())
                if reason is not None:
                    ended[row], lengths[row] = reason, step + 1
            if all(ended):
                break
        return [(tokens[row, prompts.shape[1]:prompts.shape[1] + lengths[row]].tolist(),
                 logprobs[row, :lengths[row]].tolist(), ended[row] or FinishReason.LENGTH) for row in range(rows)]

    def _ended(self, completion: list[int]) -> FinishReason | None:
        """Why ``completion``, just grown by a token, ends there; None if it goes on."""
        if completion[-1] == self._policy.eos_id:
            return FinishReason.EOS
        if self._stop and any(stop in self._policy.decode(completion) for stop in self._stop):
            return FinishReason.STOP
        return None
