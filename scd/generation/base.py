"""What the daemon needs of a generation backend.

A backend turns requests into completions (token ids, logprobs at the sampling
temperature, finish reason, the weight version that made them).  It never
scores: the daemon decodes and the task scores, in one place.  Adding a backend
means a module with its class, and its name in two tables: ``scd.generation.BACKENDS``
(the class) and ``scd.config.GENERATION_BACKENDS`` (its ``[generation.<name>]`` config
sub-table, a ``GenerationConfig`` field).

A request asks for some of a group's siblings (``GroupRequest.siblings``: all of
them at first, the missing ones after a restore or an abort).  A backend whose
siblings finish at different times reports each complete one through the
``SiblingSink`` as it finishes, so the daemon can stage it; one whose siblings
finish together need not.

Each backend also says how busy its engines are (``engine_activity``): per engine,
the time with at least one request in flight and the tokens it generated, both
cumulative.  ``BusyClock`` keeps the first; the goodput meter samples them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from scd.config import Config
from scd.model.policy import Policy
from scd.records import COMPLETE, Completion, PartialSibling, Prefix


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
    # (sibling index, prefix) for siblings a restore resumes: generated on from the prefix, at most
    # max_tokens - len(prefix) more tokens.  Only backends that are ``resumable`` are given any.
    prefixes: tuple[tuple[int, Prefix], ...] = ()
    # The sampling temperature when not generation.temperature (an eval's; 0: greedy).  Its logprobs are of
    # that distribution: such a request is never trained on.
    temperature: float | None = None

    def prefix_of(self, index: int) -> Prefix | None:
        return next((p for i, p in self.prefixes if i == index), None)


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


@dataclass(frozen=True, slots=True)
class EngineActivity:
    """One engine's work so far; both counts are cumulative over the backend's life and never go back."""

    engine: str  # the engine's label in scd_engine_busy_ratio{engine}
    busy_seconds: float  # time with at least one request in flight (monotonic clock)
    generated_tokens: int
    requests_in_flight: int


class BusyClock:
    """Time with at least one request in flight, for one engine (or any time something is held).

    Thread-safe: the torch backend counts from its worker thread while the event loop reads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_seconds = 0.0
        self._busy_since = 0.0  # when the engine last went from no request to one

    def started(self) -> None:
        """A request (or a batch of them) reached the engine."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1

    def finished(self) -> None:
        """A request ``started`` reported is done, whatever its outcome."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_seconds += time.monotonic() - self._busy_since

    @contextmanager
    def request(self) -> Iterator[None]:
        """Held while the engine works on one request (or one batch of them)."""
        self.started()
        try:
            yield
        finally:
            self.finished()

    def seconds(self) -> float:
        """Busy seconds so far, the request in progress included up to this instant."""
        with self._lock:
            return self._busy_seconds + (time.monotonic() - self._busy_since if self._in_flight else 0.0)

    def activity(self, engine: str, generated_tokens: int) -> EngineActivity:
        return EngineActivity(engine, self.seconds(), generated_tokens, self._in_flight)


class GenerationBackend(Protocol):
    # How many generate() calls may run at once (the torch sampler is one worker thread).
    max_concurrent_batches: int
    # How many groups one generate() call should be given.
    batch_groups: int
    # Whether it resumes a sibling from a prefix (``GroupRequest.prefixes``) and reports its
    # part-way siblings (``partial_siblings``); one that does not has its siblings generated again.
    resumable: bool

    def partial_siblings(self) -> list[PartialSibling]:
        """Every sibling it is generating that has tokens so far, with each token's logprob and version;
        a snapshot, taken on the event loop without waiting."""
        ...

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: SiblingSink) -> list[GroupResult]:
        """One result per request, each sibling tagged with the weight version that made it."""
        ...

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve ``weights`` as ``version``: no request starts under the new version before they are live.

        ``weights`` are the trainer's own tensors (no copy), unchanged until this returns; a backend keeps
        none of them past it.  It observes ``scd_weight_sync_seconds{path}``.
        """
        ...

    async def abort_older_than(self, version: int) -> int:
        """Abort requests that started under a weight version below ``version``; returns how many."""
        ...

    def engine_activity(self) -> Sequence[EngineActivity]:
        """Each engine's busy time and generated tokens so far (the run's total is counted where the results
        arrive: ``scd.generation.tokens``)."""
        ...

    async def aclose(self) -> None: ...


class BackendClass(Protocol):
    """What ``scd.generation.BACKENDS`` maps a name to: a backend class, opened for a config and a policy."""

    async def open(self, config: Config, policy: Policy) -> GenerationBackend:
        """A backend serving ``policy``; heavy start-up runs off the event loop."""
        ...
