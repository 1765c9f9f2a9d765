"""What the daemon needs of a generation backend.

A backend turns requests into completions (token ids, logprobs at the sampling
temperature, finish reason, the weight version that made them).  It never
scores: the daemon decodes and the task scores, in one place.  Adding a backend
means one class here and one ``[generation.<name>]`` config sub-table.

A request asks for some of a group's siblings (``GroupRequest.siblings``: all of
them at first, the missing ones after a restore or an abort).  A backend whose
siblings finish at different times reports each complete one through the
``SiblingSink`` as it finishes, so the daemon can stage it; one whose siblings
finish together need not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    siblings: tuple[int, ...]  # indices (in the group) of the siblings this request generates
    max_tokens: int
    target_step: int | None
    admitted_at: float


# (request, the sibling's index in its group, its complete completion); must not block.
SiblingSink = Callable[[GroupRequest, int, Completion], None]


@dataclass(slots=True)
class GroupResult:
    """A request back from generation: every sibling it asked for complete, or aborted with a reason."""

    request: GroupRequest
    completions: list[Completion]  # one per ``request.siblings``, in that order, when complete
    # The weight version when the last sibling finished; above the start version if a sync landed mid-group.
    end_weight_version: int
    aborted: str = ""

    def incomplete_reason(self) -> str:
        """Why this request's siblings are not all complete, or "" when they are."""
        if self.aborted:
            return self.aborted
        if len(self.completions) != len(self.request.siblings):
            return f"{len(self.completions)} of {len(self.request.siblings)} siblings"
        unfinished = [c.finish_reason for c in self.completions if c.finish_reason not in COMPLETE]
        return f"siblings ended {sorted(set(unfinished))}" if unfinished else ""


class GenerationBackend(Protocol):
    # How many generate() calls may run at once (the torch sampler is one worker thread).
    max_concurrent_batches: int
    # How many groups one generate() call should be given.
    batch_groups: int

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
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
