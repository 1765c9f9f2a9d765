"""A group's life from admission to commit, owned by one object.

A group is admitted (the cursor advances and the ledger records it in flight),
requested from generation (all siblings at first, the missing ones after an
abort or a restore), gathered sibling by sibling, and committed once complete.
A sibling that finishes while others of its group still run is staged in TQ,
so a crash does not lose it.

A finished sibling lives in up to three stores, kept consistent here and only
here: ``Rollouts`` holds it in memory (the next attempt at its group asks only
for the others); once staged, the ledger names it and TQ's staging partition
holds its bytes.  Its score (``scd.scoring``, which it is handed to as it
finishes) is kept beside it in memory until its group commits.  The rules:

* a sibling is staged only while its group is in flight and still holds that
  very completion (the group may have completed or dropped it meanwhile);
* a sibling older than the staleness window is dropped from memory and then
  unstaged, in that order, through the committer's one stream, so a staging put
  and the unstage of the same key never race;
* a sibling is scored once: its score goes with it (into a cut, back from a
  restore), and is dropped with it;
* a group is committed whole: exactly ``group_size`` complete siblings, each
  scored.

Admission is paced here too (``has_capacity``), and what generation made and
threw away (a group dropped stale, a finished sibling dropped out of the window,
an aborted sibling's partial output) is counted here, where it is dropped.

A checkpoint's cut holds the rollouts' part as a ``RolloutsCut`` (``capture``):
the finished siblings it does not stage, the part-way ones, and the scores of
the finished ones.  A restore hands
it back with the staged siblings read from TQ (``restore``), which applies the
staleness window to all of them, once.

Like vLLM's ``ParentRequest``, which keeps a request's children together, this
module never reaches up: the pumps that wait on it are woken through the
``on_change`` callback its owner hands in, and a checkpoint hands it records.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import anyio
import msgspec
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from scd.config import Config
from scd.errors import InvariantViolation
from scd.generation.base import GroupRequest, GroupResult
from scd.ledger import PromptLedger, PromptState, StagedSiblings
from scd.model.policy import Policy
from scd.model.prompts import RenderedPrompt
from scd.records import COMPLETE, Completion, PartialSibling, Prefix, Rollout, WasteReason
from scd.replay import GroupMeta, rollouts_of, sample_ids_for
from scd.rewards import RewardInput, Scored, Scorer
from scd.samplers import Sampler, gates_dispatch
from scd.scoring import ScoringStage, SiblingToScore, scores_when_available
from scd.skew import bucket_prompts
from scd.state import ControllerState
from scd.telemetry import metrics

log = logging.getLogger(__name__)

STAGE_BATCH_MAX = 256  # siblings staged in one TQ put


@dataclass(frozen=True, slots=True)
class SiblingFinished:
    """A sibling finished while others of its group still run: the committer stages it."""

    request: GroupRequest
    index: int
    completion: Completion


@dataclass(frozen=True, slots=True)
class SiblingsStale:
    """Finished siblings of an aborted group that fell out of the staleness window: unstage them."""

    group_id: str
    siblings: StagedSiblings


# A finished group is a GroupResult asking for every sibling, its completions gathered across
# attempts (and a restored cut) by sibling index.
CommitItem = SiblingFinished | SiblingsStale | GroupResult


@dataclass(frozen=True, slots=True)
class RolloutsCut:
    """The rollouts' part of a checkpoint cut: the siblings of its in-flight groups that it does not stage
    (those the ledger names, and TQ holds), by group id and sibling index."""

    finished: dict[str, dict[int, Completion]] = field(default_factory=dict)  # queued for staging, or staged since
    prefixes: dict[str, dict[int, Prefix]] = field(default_factory=dict)  # part-way
    # The scores of finished siblings, staged or in ``finished``; one without is owed its score.
    scores: dict[str, dict[int, Scored]] = field(default_factory=dict)

    def weight_version_of(self, ledger: PromptLedger, group_id: str, index: int) -> int:
        """A finished sibling's version: the cut stages it (``ledger``, the cut's) or holds it in ``finished``."""
        staged = dict(ledger.entry(group_id).staged)
        return staged[index] if index in staged else self.finished[group_id][index].weight_version

    def finished_tokens(self) -> int:
        return sum(len(c.token_ids) for siblings in self.finished.values() for c in siblings.values())

    def prefix_tokens(self) -> int:
        return sum(len(p.token_ids) for prefixes in self.prefixes.values() for p in prefixes.values())


@dataclass(frozen=True, slots=True)
class RolloutsRestored:
    """What ``Rollouts.restore`` kept of a restored cut, and what it threw away."""

    siblings_reused: int  # staged siblings within the staleness window
    siblings_rerun: int  # staged siblings out of it: unstaged, to be generated again
    stale_tokens: int  # the tokens of those
    # The cut's own siblings: tokens taken up (resumed, or finished) and thrown away (out of the window,
    # too long, or a backend that cannot resume); siblings resumed.
    prefix_tokens_reused: int
    prefix_tokens_dropped: int
    siblings_resumed: int
    scores_reused: int  # finished siblings kept with their score: never scored again
    scores_owed: int  # finished siblings kept without one: scored, not generated again


@dataclass(frozen=True, slots=True)
class RolloutsStatistics:
    awaiting_commit: int  # complete groups not committed yet (still in flight in the ledger)
    awaiting_scores: int  # of those, groups with a sibling not scored yet
    committed_tokens: int  # completion tokens of committed groups
    wasted_tokens: int  # generated tokens thrown away, for any WasteReason
    filtered_tokens: int  # completion tokens of complete groups filtered for zero reward variance (not waste)
    finished_siblings: int  # held in memory for groups still in flight, staged or not
    staged_tokens: int  # completion tokens of the finished siblings staged in TQ (what a cut keeps of them)
    finished_tokens: int  # completion tokens of every finished sibling held, staged or not
    prefix_tokens: int  # tokens of a restore's prefixes not resumed to the end yet


def _held_groups_limit(config: Config, sampler: Sampler) -> float:
    """The most groups in flight plus ready that admission allows with ``sampler``.

    A sampler that gates dispatch keeps its own rule: its quota already holds no more than the window
    can use, and after a restore under another groups_per_step it re-derives a state sure to make
    progress, which the window's cap on top could block (a refill owed to the next step would wait
    behind restored groups held for later ones).  Only a configured limit applies to it.
    """
    if not gates_dispatch(type(sampler)):
        return config.admission_capacity_groups()
    limit = config.async_rl.buffer_capacity_groups
    return math.inf if limit == "auto" else limit


class Rollouts:
    def __init__(self, config: Config, state: ControllerState, policy: Policy, prompts: list[RenderedPrompt],
                 scorer: Scorer, on_change: Callable[[], None]) -> None:
        self._config = config
        self._state = state
        self._prompts = prompts
        self._on_change = on_change
        self._group_size = config.generation.group_size
        state.use_buckets(bucket_prompts(config.task.bucket_field, [p.prompt.bucket for p in prompts],
                                         [len(p.token_ids) for p in prompts], [p.max_tokens for p in prompts]))
        # Finished siblings of in-flight groups, by group id and sibling index.
        self._finished: dict[str, dict[int, Completion]] = {}
        # A restore's prefixes of part-way siblings, by group id and sibling index: each request
        # for the sibling resumes from it, until the sibling finishes.
        self._prefixes: dict[str, dict[int, Prefix]] = {}
        # Complete groups not committed yet, by group id: still in flight in the ledger.  Each goes to the
        # committer once all its siblings are scored; a committer that stops (the run ends) leaves them here
        # for the next one.
        self._awaiting: dict[str, GroupResult] = {}
        # The scores of finished siblings of in-flight groups (in _finished or _awaiting), by group id and index.
        self._scores: dict[str, dict[int, Scored]] = {}
        self.scoring = ScoringStage(scorer, prompts, policy.decode, self._on_scored)
        # Siblings handed to the scoring stage and not scored yet.  Once the run ends (``stop_scoring``) none is
        # handed over: each stays owed its score in the last cut, so no reward is paid after that cut.
        self._being_scored = 0
        self._scoring_stopped = False
        self._scored_now: anyio.Event | None = None  # set at each score while ``stop_scoring`` waits
        self._scorer = scorer  # a restore under a changed reward set scores the ready groups again (``rescore``)
        self._decode = policy.decode
        self._committed_tokens = 0
        self._wasted_tokens = 0
        self._filtered_tokens = 0
        self._filtered_in_a_row = 0  # groups filtered since the last commit
        self._drop_zero_variance = config.async_rl.drop_zero_variance_groups
        self._capacity = _held_groups_limit(config, state.sampler)
        # In-flight groups to generate before any new admission; None until a restore (or a run) lists them.
        self._requeued: list[GroupRequest] | None = None
        # The committer's stream, open while the committer runs.
        self._to_commit: MemoryObjectSendStream[CommitItem] | None = None

    def statistics(self) -> RolloutsStatistics:
        return RolloutsStatistics(
            awaiting_commit=len(self._awaiting),
            awaiting_scores=sum(not self._fully_scored(group_id) for group_id in self._awaiting),
            committed_tokens=self._committed_tokens,
            wasted_tokens=self._wasted_tokens,
            filtered_tokens=self._filtered_tokens,
            finished_siblings=sum(len(siblings) for siblings in self._finished.values()),
            staged_tokens=self._staged_tokens(),
            finished_tokens=sum(len(c.token_ids) for siblings in self._finished.values() for c in siblings.values()),
            prefix_tokens=sum(len(p.token_ids) for prefixes in self._prefixes.values() for p in prefixes.values()),
        )

    def _staged_tokens(self) -> int:
        ledger = self._state.ledger
        return sum(len(siblings[index].token_ids) for group_id, siblings in self._finished.items()
                   if ledger.state_of(group_id) is not None
                   for index, _ in ledger.entry(group_id).staged if index in siblings)

    def finished_siblings(self, group_id: str) -> dict[int, Completion]:
        """A copy of ``group_id``'s finished siblings by index (empty when none), a complete group's too."""
        if group_id in self._awaiting:
            return dict(enumerate(self._awaiting[group_id].completions))
        return dict(self._finished.get(group_id, {}))

    def scores_of(self, group_id: str) -> dict[int, Scored]:
        """A copy of the scores of ``group_id``'s finished siblings by index (empty when none)."""
        return dict(self._scores.get(group_id, {}))

    # ---- admission and requests --------------------------------------------------------------

    def has_capacity(self) -> bool:
        """Room for one more admission: the one place the admission invariant is enforced.

        The invariant: prompts in flight (queued for generation, generating, awaiting commit) plus
        ready groups never exceed what the sampler can still train within the staleness window
        (``Config.window_capacity_groups``), capped by ``async_rl.buffer_capacity_groups``, so nothing
        is admitted only to go stale.  Restored groups count like live ones.  An ungated sampler is
        held to it here (``Config.admission_capacity_groups``); a gated one by its own quota, which
        keeps the same bound (``_held_groups_limit``).  Besides: generation's slots and the commit queue.
        """
        state, config = self._state, self._config
        return (
            state.in_flight - len(self._awaiting) < config.generation.max_inflight_prompts
            and len(self._awaiting) < config.generation.commit_queue_groups
            and state.in_flight + len(state.replay) < self._capacity
            and state.sampler.may_dispatch(state.trainer_step)
        )

    def max_tokens_of(self, group_id: str) -> int:
        """The completion budget of ``group_id``'s prompt (a sibling longer than that cannot go on)."""
        return self._prompts[self._state.ledger.entry(group_id).prompt_id].max_tokens

    def request(self, group_id: str) -> GroupRequest:
        """The group's siblings that are not finished yet (all of them for a new prompt)."""
        entry = self._state.ledger.entry(group_id)
        prompt = self._prompts[entry.prompt_id]
        finished = self._finished.get(group_id, {})
        missing = tuple(i for i in range(self._group_size) if i not in finished)
        prefixes = tuple(sorted(self._prefixes.get(group_id, {}).items()))
        return GroupRequest(group_id, entry.epoch, entry.prompt_id, prompt.token_ids, missing, prompt.max_tokens,
                            entry.target_step, time.time(), prefixes)

    async def admit(self) -> GroupRequest:
        return self.request(await self._state.admit())

    async def requeue_in_flight(self) -> int:
        """List every prompt the ledger holds in flight (a run that stopped mid-generation left them
        there) as a request for its missing siblings, to be generated before anything new is admitted."""
        self._requeued = []
        for group_id in await self._state.redispatch_in_flight():
            if group_id in self._awaiting:
                continue
            request = self.request(group_id)
            if request.siblings:
                self._requeued.append(request)
            else:
                # Every sibling came back finished (staged, or finished in the cut): it only
                # awaits its commit, as it did at the cut.
                done = self._finished[group_id].values()
                self.gather(GroupResult(request, [], end_weight_version=max(c.weight_version for c in done)))
        await self._state.count_generated_again([request.group_id for request in self._requeued])
        return len(self._requeued)

    async def take_requeued(self) -> list[GroupRequest]:
        """The requests ``requeue_in_flight`` listed (a restore lists them), listed now if nothing did."""
        if self._requeued is None:
            await self.requeue_in_flight()
        requeued, self._requeued = self._requeued or [], None
        return requeued

    # ---- a checkpoint's part ----------------------------------------------------------------------

    def capture(self, ledger: PromptLedger, running: Sequence[PartialSibling]) -> RolloutsCut:
        """The siblings of ``ledger``'s in-flight groups (a cut's) that it does not stage: finished ones
        still queued for staging (or staged since, or completing their group), and part-way ones:
        ``running`` (the backend's), else a restored prefix not resumed yet; and the scores of the finished
        ones, staged or not.  Taken after the cut: a prefix is valid whenever taken (tokens only grow), and a
        score whenever its sibling is the one the cut holds."""
        unstaged_by_group: dict[str, dict[int, Completion]] = {}
        prefixes_by_group: dict[str, dict[int, Prefix]] = {}
        scores_by_group: dict[str, dict[int, Scored]] = {}
        in_backend = {(p.group_id, p.index): p.prefix for p in running}
        for group_id in ledger.in_state(PromptState.IN_FLIGHT):
            staged_versions = dict(ledger.entry(group_id).staged)
            staged = staged_versions.keys()
            finished = self.finished_siblings(group_id)
            unstaged = {index: Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, c.weight_version)
                        for index, c in finished.items() if index not in staged}
            scores = {index: scored for index, scored in self._scores.get(group_id, {}).items()
                      if staged_versions.get(index, finished[index].weight_version) == finished[index].weight_version}
            restored = self._prefixes.get(group_id, {})
            part_way: dict[int, Prefix] = {}
            for index in range(self._group_size):
                if index in staged or index in finished:
                    continue
                prefix = in_backend.get((group_id, index), restored.get(index))
                if prefix is not None and prefix.token_ids:
                    part_way[index] = prefix
            if unstaged:
                unstaged_by_group[group_id] = unstaged
            if part_way:
                prefixes_by_group[group_id] = part_way
            if scores:
                scores_by_group[group_id] = scores
        return RolloutsCut(unstaged_by_group, prefixes_by_group, scores_by_group)

    async def restore(self, cut: RolloutsCut, staged: Mapping[str, Mapping[int, Completion]], *,
                      resumable: bool, shadow: bool) -> RolloutsRestored:
        """A restored cut's siblings (``staged``: those it staged, read back from TQ) taken up: their groups'
        next requests skip the finished ones and resume the part-way ones.

        One rule: a sibling whose oldest token is out of the staleness window is dropped and generated
        again (a staged one unstaged first), as is a part-way one when the backend cannot resume (not
        ``resumable``) or its prompt's budget has no room left, and every one in a ``shadow`` restore
        (its siblings are all generated again).  A finished sibling kept keeps its score; one the cut
        holds no score for is owed one (the scoring stage is handed it when it runs).
        """
        window_start = math.inf if shadow else self._state.window_start()
        reused = rerun = stale_tokens = 0
        for group_id, by_index in staged.items():
            stale = tuple((i, c.weight_version) for i, c in sorted(by_index.items()) if c.weight_version < window_start)
            if stale:
                await self._state.unstage_siblings(group_id, stale)
                rerun += len(stale)
                stale_tokens += sum(len(by_index[i].token_ids) for i, _ in stale)
            kept = {i: c for i, c in by_index.items() if c.weight_version >= window_start}
            if kept:
                reused += len(kept)
                self._finished.setdefault(group_id, {}).update(kept)
        reused_tokens = dropped_tokens = resumed = 0
        for group_id, completions in cut.finished.items():
            for index, completion in completions.items():
                if completion.weight_version >= window_start:
                    self._finished.setdefault(group_id, {})[index] = completion
                    reused_tokens += len(completion.token_ids)
                else:
                    dropped_tokens += len(completion.token_ids)
        for group_id, prefixes in cut.prefixes.items():
            room = self.max_tokens_of(group_id)
            for index, prefix in prefixes.items():
                if prefix.oldest_version >= window_start and resumable and len(prefix.token_ids) < room:
                    self._prefixes.setdefault(group_id, {})[index] = prefix
                    reused_tokens += len(prefix.token_ids)
                    resumed += 1
                else:
                    dropped_tokens += len(prefix.token_ids)
        scores_reused = 0
        for group_id, scores in cut.scores.items():
            kept_scores = {i: scored for i, scored in scores.items() if i in self._finished.get(group_id, {})}
            if kept_scores:
                self._scores[group_id] = kept_scores
                scores_reused += len(kept_scores)
        scores_owed = sum(len(f) for f in self._finished.values()) - scores_reused
        return RolloutsRestored(reused, rerun, stale_tokens, reused_tokens, dropped_tokens, resumed, scores_reused,
                                scores_owed)

    async def rescore(self, groups: Sequence[GroupMeta], stored: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]
                      ) -> list[GroupMeta]:
        """Ready groups scored again with this run's rewards (a restore under a changed reward set), from their
        rows as TQ holds them (``stored``, by group): each sibling once, an outage waited out as the scoring
        stage waits it out.  Returns the groups with their new rewards; their rows are the same."""
        rows = [rollouts_of(group, [ids for ids, _ in got], [lp for _, lp in got])
                for group, got in zip(groups, stored, strict=True)]

        def decoded() -> list[list[str]]:
            return [[self._decode(row.input_ids[row.prompt_len:].tolist()) for row in group_rows]
                    for group_rows in rows]

        inputs: list[RewardInput] = []
        for group, completions in zip(groups, await anyio.to_thread.run_sync(decoded), strict=True):
            prompt = self._prompts[group.prompt_id].prompt
            inputs.extend(RewardInput.of(prompt, completion) for completion in completions)
        scores = await scores_when_available(self._scorer, inputs)
        rescored, at = [], 0
        for group in groups:
            scored = scores[at:at + len(group.sample_ids)]
            at += len(scored)
            rescored.append(msgspec.structs.replace(group, rewards=tuple(s.total for s in scored),
                                                    reward_components=_mean_components(scored)))
        return rescored

    # ---- what generation reports -------------------------------------------------------------

    def on_sibling(self, request: GroupRequest, index: int, completion: Completion) -> None:
        """A backend reports a finished sibling; while others of its group run, it is worth staging.

        Once the committer has stopped (the run is ending; its last bundle holds the group in
        flight) the sibling is only kept in memory, for a later run of this controller.
        """
        finished = self._finished.setdefault(request.group_id, {})
        finished[index] = completion
        self._prefixes.get(request.group_id, {}).pop(index, None)
        self._score(SiblingToScore(request.group_id, request.prompt_id, index, completion))
        if len(finished) < self._group_size and self._to_commit is not None:
            self._to_commit.send_nowait(SiblingFinished(request, index, completion))

    def gather(self, result: GroupResult) -> bool:
        """Record a request's complete siblings; a group with all of them goes to the committer.

        Returns False when the group needs another attempt.  Once the committer has stopped (the
        run is ending) a complete group waits, in flight, for the next run's committer.
        """
        request = result.request
        finished = self._finished.setdefault(request.group_id, {})
        prefixes = self._prefixes.get(request.group_id, {})
        for index, completion in zip(request.siblings, result.completions, strict=False):
            if completion.finish_reason in COMPLETE:
                if index not in finished:  # not reported by on_sibling
                    finished[index] = completion
                    self._score(SiblingToScore(request.group_id, request.prompt_id, index, completion))
                prefixes.pop(index, None)
            else:
                # A resumed sibling's prefix is not lost with it: the next request resumes from it again.
                kept = len(prefixes[index].token_ids) if index in prefixes else 0
                self._waste(WasteReason.ABORTED, len(completion.token_ids) - kept)
        if len(finished) < self._group_size:
            return False
        del self._finished[request.group_id]
        self._prefixes.pop(request.group_id, None)
        complete = GroupResult(replace(request, siblings=tuple(range(self._group_size))),
                               [finished[i] for i in range(self._group_size)], result.end_weight_version)
        # Generation is done with it: its slot goes to the next prompt, even while it waits for its scores or
        # its commit waits on a TQ save.
        self._awaiting[request.group_id] = complete
        self._on_change()
        if self._fully_scored(request.group_id):
            self._send_to_commit(complete)
        return True

    # ---- scores ------------------------------------------------------------------------------

    def _fully_scored(self, group_id: str) -> bool:
        return len(self._scores.get(group_id, {})) == self._group_size

    def _send_to_commit(self, complete: GroupResult) -> None:
        if self._to_commit is not None:
            self._to_commit.send_nowait(complete)

    def owed_scores(self) -> list[SiblingToScore]:
        """Every finished sibling of an in-flight group without a score: what a starting scoring stage is
        handed (those finished while it did not run, or a restore kept without their score)."""
        owed = []
        for group_id in [*self._finished, *self._awaiting]:
            scores = self._scores.get(group_id, {})
            prompt_id = self._state.ledger.entry(group_id).prompt_id
            owed.extend(SiblingToScore(group_id, prompt_id, index, completion)
                        for index, completion in self.finished_siblings(group_id).items() if index not in scores)
        return owed

    async def scorer(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The scoring stage (``scd.scoring``), handed every sibling owed a score."""
        owed = self.owed_scores()
        self._being_scored, self._scoring_stopped = len(owed), False
        await self.scoring.run(owed, task_status=task_status)

    def _score(self, sibling: SiblingToScore) -> None:
        """A finished sibling to the scoring stage; once the run ends it stays owed its score instead."""
        if not self._scoring_stopped:
            self._being_scored += 1
            self.scoring.submit(sibling)

    async def stop_scoring(self, deadline_s: float) -> None:
        """The run ends: siblings that finish from now on stay owed their score (the last cut holds them, the
        next run scores them), and this waits, up to ``deadline_s``, until those handed to the scoring stage
        before are scored, so the last cut holds every score the run paid for.  A reward still out at the
        deadline is asked again by the restore."""
        self._scoring_stopped = True
        with anyio.move_on_after(deadline_s) as waiting:
            while self._being_scored:
                self._scored_now = anyio.Event()
                await self._scored_now.wait()
        self._scored_now = None
        if waiting.cancelled_caught:
            log.warning("scoring did not finish within %.0fs of the run's end: the last checkpoint holds the "
                        "siblings still being scored owed their score, and the restore scores them", deadline_s)

    def _on_scored(self, sibling: SiblingToScore, scored: Scored) -> None:
        """A sibling's score: kept with it while it is the group's, and the group goes to the committer once
        complete and scored whole.  Each sibling is scored once (enforced here)."""
        self._being_scored -= 1
        if self._scored_now is not None:
            self._scored_now.set()
        group_id, index = sibling.group_id, sibling.index
        if self.finished_siblings(group_id).get(index) is not sibling.completion:
            return  # dropped out of the staleness window while it was scored
        scores = self._scores.setdefault(group_id, {})
        if index in scores:
            raise InvariantViolation(f"sibling {index} of group {group_id} scored twice")
        scores[index] = scored
        if group_id in self._awaiting and self._fully_scored(group_id):
            self._send_to_commit(self._awaiting[group_id])

    async def redispatch_aborted(self, result: GroupResult) -> GroupRequest:
        """A group generation gave back incomplete goes to generation again for its missing siblings;
        finished ones older than the staleness window are dropped (and unstaged) first.  The ledger
        keeps why."""
        group_id, reason = result.request.group_id, result.incomplete_reason()
        finished = self._finished.get(group_id, {})
        window_start = self._state.window_start()
        stale = tuple((i, c.weight_version) for i, c in sorted(finished.items()) if c.weight_version < window_start)
        for index, _ in stale:
            self._waste(WasteReason.STALE_SIBLING, len(finished.pop(index).token_ids))
            self._scores.get(group_id, {}).pop(index, None)
        prefixes = self._prefixes.get(group_id, {})
        for index in [i for i, p in prefixes.items() if p.oldest_version < window_start]:
            self._waste(WasteReason.STALE_SIBLING, len(prefixes.pop(index).token_ids))
        if stale and self._to_commit is not None:
            self._to_commit.send_nowait(SiblingsStale(group_id, stale))
        await self._state.note_redispatch(group_id, reason)
        metrics.groups_redispatched.inc()
        log.info("group %s back to generation: %s (%d finished siblings kept)", group_id, reason, len(finished))
        return self.request(group_id)

    async def evict_stale(self, *, at_restore: bool = False) -> list[GroupMeta]:
        """Drop every ready group the sampler calls stale now (``at_restore``: those that went stale while
        the run was down); returns them."""
        stale = await self._state.evict_stale(at_restore=at_restore)
        if stale:
            metrics.groups_evicted_stale.inc(len(stale))
            self._waste(WasteReason.STALE_GROUP, sum(group.completion_tokens for group in stale))
            self._on_change()
        return stale

    def _waste(self, reason: WasteReason, tokens: int) -> None:
        self._wasted_tokens += tokens
        metrics.wasted_tokens.labels(reason.value).inc(tokens)

    # ---- the committer -----------------------------------------------------------------------

    async def committer(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """One stream, in generation's order: a sibling is staged before its group commits or is unstaged.

        Siblings queued one after another are staged together (one TQ put: a put's round trip,
        not its size, is what a sibling costs), so staging keeps up however fast siblings finish.
        """
        to_commit, items = anyio.create_memory_object_stream[CommitItem](math.inf)
        self._to_commit = to_commit
        for group_id, result in self._awaiting.items():
            if self._fully_scored(group_id):
                to_commit.send_nowait(result)
        held: CommitItem | None = None
        try:
            task_status.started()
            while True:
                item, held = (held, None) if held is not None else (await items.receive(), None)
                if isinstance(item, SiblingFinished):
                    batch = [item]
                    while len(batch) < STAGE_BATCH_MAX:
                        try:
                            following = items.receive_nowait()
                        except anyio.WouldBlock:
                            break
                        if not isinstance(following, SiblingFinished):
                            held = following
                            break
                        batch.append(following)
                    await self._stage(batch)
                elif isinstance(item, SiblingsStale):
                    await self._unstage(item)
                else:
                    try:
                        await self.commit(item, self._scores[item.request.group_id])
                    finally:
                        # Cancelled mid-commit, the group may or may not have been committed: the ledger knows.
                        group_id = item.request.group_id
                        if self._state.ledger.state_of(group_id) is not PromptState.IN_FLIGHT:
                            del self._awaiting[group_id]
                            del self._scores[group_id]
        finally:
            self._to_commit = None
            to_commit.close()
            items.close()

    async def _stage(self, items: list[SiblingFinished]) -> None:
        """Stage finished siblings in one TQ put, except those whose group has since completed or
        dropped them."""
        current = [(i.request.group_id, i.index, i.completion) for i in items
                   if self._finished.get(i.request.group_id, {}).get(i.index) is i.completion]
        if current:
            await self._state.stage_siblings(current)
            metrics.siblings_staged.inc(len(current))

    async def _unstage(self, item: SiblingsStale) -> None:
        staged = set(self._state.ledger.entry(item.group_id).staged)
        await self._state.unstage_siblings(item.group_id, tuple(s for s in item.siblings if s in staged))

    def _rollouts(self, result: GroupResult, scores: Mapping[int, Scored]) -> list[Rollout]:
        """The group's rows, each with its sibling's reward."""
        req = result.request
        completions = result.completions
        # One tensor per field for the whole group, split into per-sibling views (TQ copies each row).
        ids = torch.tensor([t for c in completions for t in (*req.prompt_ids, *c.token_ids)], dtype=torch.int64)
        logprobs = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32)
        id_rows = ids.split([len(req.prompt_ids) + len(c.token_ids) for c in completions])
        logprob_rows = logprobs.split([len(c.logprobs) for c in completions])
        return [
            Rollout(input_ids=row_ids, logprobs=row_logprobs, prompt_len=len(req.prompt_ids),
                    reward=scores[index].total, weight_version=c.weight_version,
                    truncated=c.truncated)
            for index, (c, row_ids, row_logprobs) in enumerate(zip(completions, id_rows, logprob_rows, strict=True))
        ]

    async def commit(self, result: GroupResult, scores: Mapping[int, Scored]) -> None:
        """Commit a finished group with its siblings' ``scores``.  Only a complete group is committed (enforced
        here): exactly ``group_size`` siblings, none aborted, each scored.  With
        ``async_rl.drop_zero_variance_groups``, one whose rewards are all equal is filtered instead: never put in
        TQ nor trained, its prompt done for the epoch."""
        req = result.request
        incomplete = result.incomplete_reason()
        if req.siblings != tuple(range(self._group_size)):
            incomplete = f"siblings {list(req.siblings)} of {self._group_size}"
        if not incomplete and not all(index in scores for index in range(self._group_size)):
            incomplete = f"scores of siblings {sorted(scores)} only"
        if incomplete:
            raise InvariantViolation(f"commit of incomplete group {req.group_id}: {incomplete}")
        rollouts = self._rollouts(result, scores)
        group = GroupMeta(
            group_id=req.group_id, epoch=req.epoch, prompt_id=req.prompt_id,
            sample_ids=sample_ids_for(req.group_id, len(rollouts)),
            start_weight_version=min(c.weight_version for c in result.completions),
            end_weight_version=result.end_weight_version,
            prompt_len=len(req.prompt_ids), seq_lens=tuple(r.input_ids.shape[0] for r in rollouts),
            rewards=tuple(r.reward for r in rollouts), weight_versions=tuple(r.weight_version for r in rollouts),
            truncated=tuple(r.truncated for r in rollouts),
            target_step=req.target_step, admitted_at=req.admitted_at, committed_at=time.time(),
            reward_components=_mean_components(scores[index] for index in range(self._group_size)),
        )
        if self._drop_zero_variance and has_zero_variance(group.rewards):
            await self._state.filter(group)
            self._filtered_tokens += group.completion_tokens
            metrics.groups_filtered.inc()
            metrics.filtered_tokens.inc(group.completion_tokens)
            self._filtered_in_a_row += 1
            if self._filtered_in_a_row % len(self._prompts) == 0:
                # No step can fill while this lasts: say so, as verl's max_num_gen_batches would, but go on
                # (sampling may yet draw a group whose rewards differ; the weights cannot move before it does).
                log.warning("the last %d complete groups, an epoch's worth of prompts, were all filtered "
                            "(async_rl.drop_zero_variance_groups): each one's rewards were all equal, so no train "
                            "step can fill; check the reward", self._filtered_in_a_row)
            self._on_change()
            return
        self._filtered_in_a_row = 0
        await self._state.commit(group, rollouts)
        self._committed_tokens += group.completion_tokens
        metrics.committed_groups.inc()
        metrics.committed_tokens.inc(group.completion_tokens)
        metrics.group_completion_latency.observe(group.committed_at - req.admitted_at)
        self._on_change()


def has_zero_variance(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are all exactly equal (a group of one too): every GRPO advantage is then 0, the
    group carries no signal.  Exact, not within a tolerance: rewards that differ at all rank the completions."""
    return all(reward == rewards[0] for reward in rewards)


def _mean_components(scores: Iterable[Scored]) -> dict[str, float]:
    """Each component's mean over the siblings that have it (a dict-returning reward may name other parts
    for other completions)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for scored in scores:
        for name, value in scored.components.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}
