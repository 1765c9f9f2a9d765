"""vLLM generation (optional extra ``scd[vllm]``, needs CUDA); imported only when configured.

One ``AsyncLLMEngine.generate`` call per group with ``SamplingParams(n=group_size,
logprobs=0)`` returns the sampled tokens with their logprobs.  Weight sync pauses
generation, reloads the weights in place, and resumes.  vLLM's own Prometheus
families register on the process's default registry, so /metrics shows them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from scd.config import Config
from scd.errors import ConfigError
from scd.generation.base import GroupRequest, GroupResult
from scd.records import Rollout
from scd.tasks import reward


class VLLMBackend:
    max_concurrent_batches = 64
    batch_groups = 1

    def __init__(self, config: Config) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError("generation.backend",
                              f"'vllm' needs the optional extra: pip install 'scd[vllm]' ({exc})") from None
        if not torch.cuda.is_available():
            raise ConfigError("generation.backend", "'vllm' needs a CUDA device; none is visible")
        self._vllm = vllm
        self._config = config
        self._engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(
            model=config.model.name, gpu_memory_utilization=config.generation.gpu_memory_utilization,
            seed=config.run.seed,
        ))
        self._tokenizer: Any = None
        self._version = 0
        self._tokens = 0

    async def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            self._tokenizer = await self._engine.get_tokenizer()
        return self._tokenizer.encode(text)

    async def generate(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        results: list[GroupResult] = []
        for req in requests:
            results.append(await self._generate_group(req))
        return results

    async def _generate_group(self, req: GroupRequest) -> GroupResult:
        version = self._version
        params = self._vllm.SamplingParams(
            n=req.group_size, temperature=self._config.generation.temperature,
            max_tokens=self._config.generation.max_new_tokens, logprobs=0, seed=None,
        )
        prompt_ids = await self._tokenize(req.prompt.text)
        final = None
        async for output in self._engine.generate({"prompt_token_ids": prompt_ids}, params,
                                                  request_id=f"{req.group_id}-{uuid.uuid4().hex[:8]}"):
            final = output
        assert final is not None
        answer = await self._tokenize(req.prompt.answer)
        rollouts = []
        for completion in final.outputs:
            ids = list(completion.token_ids)
            logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, ids, strict=True)]
            self._tokens += len(ids)
            rollouts.append(Rollout(
                input_ids=torch.tensor(prompt_ids + ids, dtype=torch.int64),
                logprobs=torch.tensor(logprobs, dtype=torch.float32), prompt_len=len(prompt_ids),
                reward=reward(ids, answer), weight_version=version,
            ))
        return GroupResult(req, rollouts)

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        await self._engine.pause_generation()
        try:
            await self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        finally:
            await self._engine.resume_generation()
        self._version = version

    def generated_tokens(self) -> int:
        return self._tokens

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self._engine.shutdown)
