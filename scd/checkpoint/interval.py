"""How long between checkpoints: fixed, or the Young/Daly optimum from what checkpoints cost the run.

With a checkpoint cost C and a mean time between failures M, checkpointing every √(2·C·M)
minimises the expected time lost to checkpoints plus the work redone after a failure (Young 1974;
Daly 2006).  ``checkpointing.interval_s = "auto"`` applies it live:

* C is what a checkpoint costs the run, not the writer's wall time: the train pump's wait (the
  cut and the trainer state's capture) plus the wait of the first admission or commit it held
  up (generation's loss: engines never pause), the median of the last ``RECENT`` checkpoints.
* M is ``checkpointing.mtbf_s`` when set; else the run's own history: the seconds it has run (each
  process's share by its own monotonic clock, carried in the cut: never a difference of two
  processes' wall clocks) divided by the restarts that followed a crash, those that restored a
  bundle other than a clean exit's.  With no crash yet, M is unbounded and the interval
  ``max_interval_s``.  An estimate that is not positive falls to the clamps and is counted
  (``scd_checkpoint_interval_fallbacks_total``).
* The result is clamped to [``min_interval_s``, ``max_interval_s``]; before the first checkpoint
  has been measured it is ``min_interval_s`` (measure early).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

from scd.config import CheckpointingConfig
from scd.schema import CheckpointPhase, RunIdentity
from scd.telemetry import metrics

RECENT = 5
# The phases that make a checkpoint's cost to the run.
COST_PHASES = (CheckpointPhase.TRAIN_PUMP_BLOCKED, CheckpointPhase.STATE_COPY, CheckpointPhase.MUTATIONS_BLOCKED)


def cost_of(phases: dict[str, float]) -> float:
    """What one checkpoint cost the run, in seconds."""
    return sum(phases.get(phase, 0.0) for phase in COST_PHASES)


def young_daly(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * cost_s * mtbf_s)


class CheckpointInterval:
    def __init__(self, config: CheckpointingConfig, run: Callable[[], RunIdentity],
                 run_seconds: Callable[[], float]) -> None:
        self._config = config
        self._run = run
        self._run_seconds = run_seconds
        self._costs: deque[float] = deque(maxlen=RECENT)

    @property
    def auto(self) -> bool:
        return self._config.interval_s == "auto"

    def observe(self, phases: dict[str, float]) -> None:
        """A completed checkpoint's phases."""
        self._costs.append(cost_of(phases))

    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def mtbf_s(self) -> float:
        if self._config.mtbf_s:
            return self._config.mtbf_s
        crashes = self._run().crash_restores
        return self._run_seconds() / crashes if crashes else math.inf

    def seconds(self) -> float:
        """The interval to wait now (published as ``scd_checkpoint_interval_seconds``)."""
        config = self._config
        if config.interval_s != "auto":
            interval = config.interval_s
        else:
            cost, mtbf = self.cost_s(), self.mtbf_s()
            if cost is None:
                optimum = config.min_interval_s
            elif cost > 0 and mtbf > 0:
                optimum = young_daly(cost, mtbf)
            else:
                metrics.checkpoint_interval_fallbacks.inc()
                optimum = config.min_interval_s
            interval = min(max(optimum, config.min_interval_s), config.max_interval_s)
        metrics.checkpoint_interval.set(interval)
        return interval
