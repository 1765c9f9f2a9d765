"""vLLM's own ``vllm:`` metrics for every engine of a run, each engine under its scd index.

vLLM's ``PrometheusStatLogger`` belongs to one AsyncLLM, and making one
unregisters every ``vllm:`` collector in the process first.  scd's engines are
separate AsyncLLMs in one process, so each engine's logger hid the one before:
``/metrics`` showed the last engine alone.  A run keeps one logger made for all
of its engine indexes, and each engine's AsyncLLM gets a stand-in
(``logger_for``) that records into it under that engine's index in the
``engine`` label, the index ``scd_engine_*`` families carry.
"""

from __future__ import annotations

import threading
from typing import Any


class SharedVllmMetrics:
    """The one vLLM Prometheus logger of a run's ``count`` engines, made when the first engine starts."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._lock = threading.Lock()  # engines start in worker threads
        self._logger: Any = None
        self._described = False

    def _opened(self, vllm_config: Any) -> Any:
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        with self._lock:
            if self._logger is None:
                self._logger = PrometheusStatLogger(vllm_config, list(range(self.count)))
            return self._logger

    def _describe_once(self) -> None:
        # The cache-config info gauge is registered by the call itself: a second call would register it twice.
        with self._lock:
            if not self._described:
                self._described = True
                self._logger.log_engine_initialized()

    def logger_for(self, index: int) -> type:
        """The stat-logger class to give engine ``index``'s AsyncLLM (vLLM takes a class and makes it)."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        shared = self

        # A PrometheusStatLogger by type, so vLLM adds no logger of its own; it shares the run's collectors
        # instead of making (and unregistering) its own.
        class EngineStatLogger(PrometheusStatLogger):
            def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
                self.engine_indexes = [index]
                self.shared = shared._opened(vllm_config)
                # vLLM's own record_sleep_state sets these for engine_indexes: this engine's alone.
                self.gauge_engine_sleep_state = self.shared.gauge_engine_sleep_state

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                self.shared.record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx=index)

            def record_admission_rejection(self, reason: str) -> None:
                self.shared.record_admission_rejection(reason)

            def log_engine_initialized(self) -> None:
                shared._describe_once()

        return EngineStatLogger
