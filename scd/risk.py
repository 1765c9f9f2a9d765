"""The loss window: what a crash right now would lose, live.

``scd_work_at_risk_tokens``: generated tokens (not already thrown away) that the newest finalized
bundle would not give back: those generated since its cut, plus those in flight at the cut that
it did not hold.  A cut holds its committed groups' tokens, its staged siblings', and its
rollouts' part's: finished siblings still queued for staging, and part-way ones where the backend
resumes them (``GenerationBackend.resumable``); a group filtered for zero reward variance is held once a
cut records it.  ``scd_work_at_risk_seconds``: the age of
that cut (before the first bundle: of this process's start, or of the bundle it restored).

Counts are this process's: a restore starts the count at zero, the restored bundle's cut time
kept.  Siblings a restore reused from staging count as held at the next cut without having been
generated here, so right after a restore the figure can read low by them; it is floored at 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from scd.generation.base import GenerationBackend
from scd.generation.tokens import TokenCounter
from scd.rollouts import Rollouts, RolloutsCut
from scd.telemetry import metrics


@dataclass(frozen=True, slots=True)
class CutMark:
    wall: float  # wall-clock time of the cut
    useful: int  # generated minus wasted tokens, this process, at the cut
    unheld: int  # of those, what the cut does not hold


class WorkAtRisk:
    def __init__(self, rollouts: Rollouts, backend: GenerationBackend, tokens: TokenCounter) -> None:
        self._rollouts = rollouts
        self._backend = backend
        self._tokens = tokens
        stats = rollouts.statistics()
        self._generated_at_start = tokens.statistics().generated_tokens
        self._wasted_at_start = stats.wasted_tokens
        self._kept_at_start = stats.committed_tokens + stats.filtered_tokens
        self._newest = CutMark(time.time(), 0, 0)

    def _useful(self) -> int:
        generated = self._tokens.statistics().generated_tokens - self._generated_at_start
        return generated - (self._rollouts.statistics().wasted_tokens - self._wasted_at_start)

    def mark_cut(self, rollouts: RolloutsCut) -> CutMark:
        """Called at a cut, with the rollouts' part it captured: what it holds of the work so far."""
        stats = self._rollouts.statistics()
        useful = self._useful()
        unstaged = rollouts.finished_tokens() + (rollouts.prefix_tokens() if self._backend.resumable else 0)
        # A filtered group's tokens are held like a committed one's: the cut records its fate, nothing to redo.
        held = stats.committed_tokens + stats.filtered_tokens - self._kept_at_start + stats.staged_tokens + unstaged
        return CutMark(time.time(), useful, max(0, useful - held))

    def finalized(self, mark: CutMark) -> None:
        """The bundle of ``mark``'s cut is the newest finalized one."""
        self._newest = mark
        self.publish()

    def restored(self, bundle_time: float) -> None:
        """This process continues from a bundle cut at ``bundle_time``: everything it generates is at risk."""
        self._newest = CutMark(bundle_time, 0, 0)

    def tokens(self) -> int:
        return max(0, self._newest.unheld + self._useful() - self._newest.useful)

    def seconds(self) -> float:
        return time.time() - self._newest.wall

    def publish(self) -> None:
        metrics.work_at_risk_tokens.set(self.tokens())
        metrics.work_at_risk_seconds.set(self.seconds())
