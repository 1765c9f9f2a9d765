"""What tests read of a ``VLLMBackend``'s engines, through their public surface."""

from __future__ import annotations

from typing import Any

from scd.generation.vllm_backend import VLLMBackend


def running_requests(backend: VLLMBackend) -> int:
    """Requests the engines are generating now."""
    return sum(len(engine.running) for engine in backend.engines)


def vllm_generated_tokens(backend: VLLMBackend) -> float:
    """vLLM's own count of the tokens these engines generated (``vllm:generation_tokens``), read from the
    logger they share: the process registry shows only the newest one (making a vLLM Prometheus logger
    unregisters every ``vllm:`` collector, and a test may open another AsyncLLM after this backend)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    shared = {id(logger.shared): logger.shared for engine in backend.engines
              for logger in engine.llm.logger_manager.stat_loggers if isinstance(logger, PrometheusStatLogger)}
    return sum(child._value.get() for logger in shared.values() for child in logger.counter_generation_tokens.values())


async def engines_paused(backend: VLLMBackend) -> list[bool]:
    """Whether each engine's scheduler is paused now (a failed sync leaves them paused)."""
    return [await engine.llm.is_paused() for engine in backend.engines]


async def worker_parameters(backend: VLLMBackend) -> list[list[dict[str, Any]]]:
    """Per engine, per worker, its parameters as raw bytes (read back through collective_rpc)."""
    return [await engine.llm.collective_rpc("scd_parameter_bytes") for engine in backend.engines]
