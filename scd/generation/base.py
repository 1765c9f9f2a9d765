"""What the daemon needs of a generation backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scd.records import Rollout
from scd.tasks import Prompt


@dataclass(frozen=True, slots=True)
class GroupRequest:
    group_id: str
    epoch: int
    prompt: Prompt
    group_size: int
    target_step: int | None
    admitted_at: float


@dataclass(slots=True)
class GroupResult:
    request: GroupRequest
    rollouts: list[Rollout]

    @property
    def start_weight_version(self) -> int:
        return min(r.weight_version for r in self.rollouts)

    @property
    def end_weight_version(self) -> int:
        return max(r.weight_version for r in self.rollouts)


class GenerationBackend(Protocol):
    # How many generate() calls may run at once (the torch sampler is one worker thread).
    max_concurrent_batches: int
    # How many groups one generate() call should be given.
    batch_groups: int

    async def generate(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        """One finished group per request, every sibling tagged with the weight version that made it."""
        ...

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None: ...

    def generated_tokens(self) -> int:
        """Cumulative tokens the backend has generated, monotonic across its lifetime."""
        ...

    async def aclose(self) -> None: ...
