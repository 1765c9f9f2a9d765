"""The learning-rate schedule: a pure function of the optimizer steps taken, so its whole state is that count
(a bundle restores it with the step, and a schedule changed across a restore applies from the restored step
on, with no scheduler object whose saved state could disagree with the config)."""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "cosine", "linear"]


def lr_factor(step: int, *, total_steps: int, schedule: Schedule, warmup_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """The factor of ``trainer.lr`` for the optimizer step that follows ``step`` steps taken (0 for the first).

    Warmup rises linearly to 1 over ``warmup_steps`` steps, ``(step + 1) / warmup_steps``: no step trains at
    lr 0, and the last warmup step trains at the full lr.  Then ``constant`` stays at 1, while ``linear`` and
    ``cosine`` decay from 1 to ``min_lr_ratio`` at ``total_steps`` and stay there (a run extended past its
    planned steps trains at the floor, not at a cosine rising again).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * decay
