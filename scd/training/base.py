"""What the controller needs of a trainer: in its own process (``GRPOTrainer``) or a group of ranks on
Ray (``TrainerGroup``); the controller cannot tell them apart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from scd.records import Rollout
from scd.training.loss import RatioSums


@dataclass(slots=True)
class StepResult:
    loss: float
    reward_mean: float
    clip_fraction: float
    entropy: float
    tokens: int
    # |trainer logprob - generation logprob| over the tokens of rows made entirely by the weights
    # being trained (other rows differ by design); None when the step had no such row.
    logprob_mismatch_mean: float | None
    logprob_mismatch_max: float | None
    logprob_mismatch_tokens: int
    # Seconds the slowest and the fastest rank took (equal at world size 1).
    slowest_rank_s: float = 0.0
    fastest_rank_s: float = 0.0
    # The step's token statistics by staleness (versions the weights that drew a row lag the trained ones).
    is_ratio: dict[int, RatioSums] = field(default_factory=dict)
    # Why the step took no optimizer step ("loss" or "grad_norm": not finite); None: it took one.
    skipped: str | None = None
    # The learning rate of its optimizer step (trainer.lr_schedule), also of a skipped one's.
    lr: float = 0.0

    def behaviour_kl(self) -> dict[str, float]:
        """Per staleness: the mean per-token k3 estimate of KL(behaviour ‖ proximal), how far the engine that drew
        the tokens was from the weights the step starts from."""
        return {str(lag): sums.behaviour_kl_sum / sums.tokens for lag, sums in self.is_ratio.items() if sums.tokens}

    def is_ratio_stats(self) -> dict[str, dict[str, float]]:
        """Per staleness: the mean and max proximal ÷ behaviour ratio of its tokens, and the share of them whose
        weight the off-policy correction capped or masked."""
        return {str(lag): {"mean": sums.is_ratio_sum / sums.tokens, "max": sums.is_ratio_max,
                           "clipped_share": sums.corrected / sums.tokens}
                for lag, sums in self.is_ratio.items() if sums.tokens}

    def event_fields(self) -> dict[str, object]:
        """The ``train_step`` event's fields from this result."""
        return {"reward_mean": self.reward_mean, "loss": self.loss, "clip_fraction": self.clip_fraction,
                "entropy": self.entropy, "trained_tokens": self.tokens,
                "logprob_mismatch_mean": self.logprob_mismatch_mean, "logprob_mismatch_max": self.logprob_mismatch_max,
                "logprob_mismatch_tokens": self.logprob_mismatch_tokens,
                "slowest_rank_ms": self.slowest_rank_s * 1e3, "fastest_rank_ms": self.fastest_rank_s * 1e3,
                # Flat, "staleness/stat", as the trackers name a mapping's numbers.
                "is_ratio": {f"{lag}/{stat}": value for lag, stats in self.is_ratio_stats().items()
                             for stat, value in stats.items()},
                "behaviour_kl": self.behaviour_kl(), "lr": self.lr}


@dataclass(slots=True)
class StepShare:
    """One rank's share of a step: sums over its rows, added up across ranks by ``combine``."""

    loss: float  # already divided by the whole step's tokens
    tokens: int
    clipped_tokens: float
    entropy_sum: float
    mismatch_sum: float
    mismatch_max: float
    mismatch_tokens: int
    seconds: float
    ratios: dict[int, RatioSums]  # this rank's token statistics by staleness
    skipped: str | None  # StepResult.skipped
    lr: float


@dataclass(frozen=True, slots=True)
class TrainerStatistics:
    world_size: int
    # Seconds the last weight sync spent gathering whole tensors out of the shards (0 at world size 1:
    # generation reads the trainer's own tensors).
    last_export_s: float


class StateCapture(Protocol):
    def write(self, model_path: Path, optimizer_path: Path) -> tuple[str, str]:
        """Write the captured weights and optimizer state; their files' BLAKE3 digests, computed as they were
        written.  Blocking (the checkpoint writer's thread).  Releases the capture, written or not."""
        ...

    def release(self) -> None:
        """Free what the capture holds (host buffers kept for the next capture), once: the checkpointer calls it
        when the bundle is done, written or discarded."""
        ...


class Trainer(Protocol):
    def step(self, groups: Sequence[Sequence[Rollout]], weight_version: int) -> StepResult:
        """One optimisation step; blocking (a worker thread)."""
        ...

    def capture_state(self) -> StateCapture:
        """The state at this step boundary, for a checkpoint written while training goes on.  Cheap
        for the caller: the next ``step`` starts after the capture, wherever the state lives."""
        ...

    def load_state_files(self, model_path: Path, optimizer_path: Path) -> dict[str, list[float]]:
        """Load a bundle's weights and optimizer state (written at any world size); blocking.  The configured
        optimizer settings apply: returns each that differs from the bundle's, ``[old, new]``."""
        ...

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        """The whole weights for a sync, valid until the next step; read them from a worker thread."""
        ...

    def statistics(self) -> TrainerStatistics: ...
