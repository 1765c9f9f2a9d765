"""The embedded default: batched sampling from the policy's own torch model, in one worker thread."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import anyio
import torch
import torch.nn.functional as F

from scd.config import Config
from scd.generation.base import BusyClock, EngineActivity, GroupRequest, GroupResult, SiblingSink
from scd.model.policy import Policy
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
        self._temperature = config.generation.temperature
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
        by_shape: dict[tuple[int, int], list[GroupRequest]] = defaultdict(list)
        for req in requests:
            by_shape[(len(req.prompt_ids), req.max_tokens)].append(req)
        results: dict[str, GroupResult] = {}
        for (prompt_len, new_tokens), reqs in by_shape.items():
            prompts = torch.tensor([req.prompt_ids for req in reqs for _ in req.siblings], dtype=torch.int64)
            tokens, logprobs = self._sample(prompts, new_tokens)
            row = 0
            for req in reqs:
                completions = []
                for _ in req.siblings:
                    completions.append(Completion(
                        token_ids=tokens[row, prompt_len:].tolist(), logprobs=logprobs[row].tolist(),
                        finish_reason=FinishReason.LENGTH, weight_version=version,
                    ))
                    row += 1
                results[req.group_id] = GroupResult(req, completions, end_weight_version=version)
            with self._tokens_lock:
                self._tokens += new_tokens * prompts.shape[0]
        return [results[req.group_id] for req in requests]

    def _sample(self, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = prompts
        logprobs = []
        for _ in range(new_tokens):
            logits = self._policy.logits(self._model, tokens)[:, -1] / self._temperature
            logp = F.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=self._rng)
            logprobs.append(logp.gather(-1, nxt))
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens, torch.cat(logprobs, dim=1)
