"""One vLLM engine (``vllm.AsyncLLMEngine``, the v1 AsyncLLM) and what scd keeps of it.

An engine starts in a worker thread (it loads the model and spawns the
engine-core process), so signals, /metrics and the watchdog keep running.  It
gets devices of its own (``scd.cluster``), through the environment
its processes inherit, and its workers import ``scd.generation.weight_transfer``,
which kills the engine when scd exits, however it exits.  ``on_every_engine``
makes one call on several engines at once and notices any of them dying
meanwhile; an engine that dies raises ``EngineFailed`` naming it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import anyio

from scd.cluster import EngineDevices
from scd.config import Config
from scd.errors import ScdError
from scd.generation.base import BusyClock
from scd.model.policy import Policy
from scd.telemetry import metrics

log = logging.getLogger(__name__)

# os.environ belongs to the whole process: engines start one at a time, each inheriting only its own devices.
_ENVIRONMENT_LOCK = threading.Lock()
RESTART = "scd stops without touching its checkpoints; `scd run` again restores the newest bundle"
# How often a call on every engine checks that each is still alive.
DEATH_POLL_S = 0.5


class EngineFailed(ScdError):
    """An engine died, or holds no whole weight version and none can be given to it: scd stops (exit 1)."""


class VLLMEngine:
    """One AsyncLLM and what scd keeps of it."""

    def __init__(self, llm: Any, devices: EngineDevices, count: int, rank_offset: int) -> None:
        self.llm = llm
        self.devices = devices
        self.label = str(devices.index)  # scd_engine_*{engine}
        self.name = engine_name(devices, count)
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
        return EngineFailed(f"{self.name} died ({cause}); {RESTART}")

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


class CallFailed(Exception):
    """A call on every engine failed somewhere; ``failures`` maps each engine (None: scd's side) to its error."""

    def __init__(self, what: str, failures: Mapping[VLLMEngine | None, BaseException]) -> None:
        parts = [f"{engine.name if engine else 'scd (the sender)'}: {error!r}" for engine, error in failures.items()]
        super().__init__(f"{what} failed on {'; '.join(parts)}")
        self.failures = dict(failures)

    def engines_left_mixed(self, engines: Sequence[VLLMEngine]) -> list[VLLMEngine]:
        """The engines a failed weight update may leave without a whole version: those named, or all when
        scd's side failed."""
        named = [engine for engine in self.failures if engine is not None]
        return named if named and None not in self.failures else list(engines)


async def on_every_engine(engines: Sequence[VLLMEngine], what: str, call: Callable[[VLLMEngine], Awaitable[object]],
                          sender: Callable[[], None] | None = None) -> None:
    """``call`` on every engine at once, and ``sender`` (blocking) in a worker thread beside them.

    A dead engine raises ``EngineFailed`` naming it; any other failure ``CallFailed``."""
    failures: dict[VLLMEngine | None, BaseException] = {}

    async def on(engine: VLLMEngine) -> None:
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
        while not any(engine.died() for engine in engines):
            await anyio.sleep(DEATH_POLL_S)
        scope.cancel()

    async with anyio.create_task_group() as watch:
        watch.start_soon(stop_at_a_death, watch.cancel_scope, name=f"{what}: engine deaths")
        async with anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(on, engine, name=f"{what} on engine {engine.label}")
            if sender is not None:
                tg.start_soon(send, sender, name=f"{what}: scd's side")
        watch.cancel_scope.cancel()
    for engine in engines:
        if engine.died():
            error = failures.get(engine)
            raise engine.failed(f"during {what}{f': {error!r}' if error else ''}")
    if failures:
        raise CallFailed(what, failures)


async def on_every_engine_or_stop(engines: Sequence[VLLMEngine], what: str,
                                  call: Callable[[VLLMEngine], Awaitable[object]]) -> None:
    """``call`` on every engine at once; any failure stops scd (for calls with no fallback)."""
    try:
        await on_every_engine(engines, what, call)
    except CallFailed as exc:
        raise EngineFailed(f"{exc}. {RESTART}") from None


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


async def start_engine(config: Config, policy: Policy, devices: EngineDevices, count: int, vllm: Any,
                       stat_logger: type) -> Any:
    """A started AsyncLLM on ``devices``, the ``count``-engine run's engine ``devices.index``, recording vLLM's
    metrics through ``stat_logger`` (``SharedVllmMetrics.logger_for``)."""
    from scd.generation.weight_transfer import LOOPBACK_HOST, LOOPBACK_INTERFACES, OWNER_ENV

    name = engine_name(devices, count)
    args = vllm.AsyncEngineArgs(**engine_args(config, policy, devices))
    environment = {
        # vLLM's own sockets on loopback: its default is the address of the first network interface, and
        # gloo's and NCCL's follow the hostname or the first interface.
        "VLLM_HOST_IP": LOOPBACK_HOST, "VLLM_LOOPBACK_IP": LOOPBACK_HOST, **LOOPBACK_INTERFACES,
        OWNER_ENV: str(os.getpid()), **devices.environment(),
    }

    def start() -> Any:
        with _environment(environment):
            return vllm.AsyncLLMEngine.from_engine_args(args, stat_loggers=[stat_logger])

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


def engine_name(devices: EngineDevices, count: int) -> str:
    """How errors and logs name an engine."""
    return f"vLLM engine {devices.index} of {count} ({devices.describe()})"
