"""What the daemon needs of a generation backend.

A backend turns requests into completions (token ids, logprobs at the sampling
temperature, finish reason, the weight version that made them).  It never
scores: the daemon decodes and the task scores, in one place.  Adding a backend
means one class here and one ``[generation.<name>]`` config sub-table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scd.records import COMPLETE, Completion


@dataclass(frozen=True, slots=True)
class GroupRequest:
    group_id: str
    epoch: int
    prompt_id: int
    prompt_ids: tuple[int, ...]
    group_size: int
    max_tokens: int
    target_step: int | None
    admitted_at: float


@dataclass(slots=True)
class GroupResult:
    """A group back from generation: complete, or aborted with a reason and never committed."""

    request: GroupRequest
    completions: list[Completion]
    # The weight version when the last sibling finished; above the start version if a sync landed mid-group.
    end_weight_version: int
    aborted: str = ""

    @property
    def start_weight_version(self) -> int:
        return min(c.weight_version for c in self.completions)

    def incomplete_reason(self) -> str:
        """Why this group may not be committed, or "" when every sibling is complete."""
        if self.aborted:
            return self.aborted
        if len(self.completions) != self.request.group_size:
            return f"{len(self.completions)} of {self.request.group_size} siblings"
        unfinished = [c.finish_reason for c in self.completions if c.finish_reason not in COMPLETE]
        return f"siblings ended {sorted(set(unfinished))}" if unfinished else ""


class GenerationBackend(Protocol):
    # How many generate() calls may run at once (the torch sampler is one worker thread).
    max_concurrent_batches: int
    # How many groups one generate() call should be given.
    batch_groups: int

    async def generate(self, requests: Sequence[GroupRequest]) -> list[GroupResult]:
        """One result per request, each sibling tagged with the weight version that made it."""
        ...

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Serve ``weights`` as ``version``: no request starts under the new version before they are live."""
        ...

    async def abort_older_than(self, version: int) -> int:
        """Abort requests that started under a weight version below ``version``; returns how many."""
        ...

    def generated_tokens(self) -> int:
        """Cumulative tokens the backend has generated, monotonic across its lifetime."""
        ...

    async def aclose(self) -> None: ...
