"""The prompt ledger: every admitted prompt, tracked to a terminal state.

States move only forward: in_flight -> ready -> consumed, or any
non-terminal state -> dropped (with a reason), or in_flight -> filtered (dynamic
sampling: a complete group whose rewards are all equal, never committed nor trained).  A prompt is admitted at most
once per epoch; admitting it again is an invariant violation, never a silent
discard.

An in-flight entry also records which of its group's siblings are finished and
staged in TQ (index and weight version each), so a restore generates only the
missing ones.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, replace

from scd.errors import InvariantViolation
from scd.schema import LedgerDocument, LedgerEntryRecord


class PromptState(enum.StrEnum):
    IN_FLIGHT = "in_flight"
    READY = "ready"
    CONSUMED = "consumed"
    DROPPED = "dropped"
    # Complete and scored, its rewards all equal (``async_rl.drop_zero_variance_groups``): done for its epoch.
    FILTERED = "filtered"


class DropReason(enum.StrEnum):
    STALE = "stale"


_NEXT: dict[PromptState, frozenset[PromptState]] = {
    PromptState.IN_FLIGHT: frozenset({PromptState.READY, PromptState.DROPPED, PromptState.FILTERED}),
    PromptState.READY: frozenset({PromptState.CONSUMED, PromptState.DROPPED}),
    PromptState.CONSUMED: frozenset(),
    PromptState.DROPPED: frozenset(),
    PromptState.FILTERED: frozenset(),
}


def group_id_for(epoch: int, prompt_id: int) -> str:
    return f"e{epoch}-p{prompt_id}"


def staged_key(group_id: str, index: int, weight_version: int) -> str:
    """A staged sibling's TQ key.  The version is part of it: a sibling generated again (its staged
    copy fell out of the staleness window) never reuses a key whose deferred clear may still be owed."""
    return f"{group_id}/{index}/v{weight_version}"


# (sibling index, weight version it was generated under), sorted by index.
StagedSiblings = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """Immutable: a change replaces the entry, so a copied ledger (a checkpoint's cut) never sees it."""

    epoch: int
    prompt_id: int
    state: PromptState
    reason: str = ""
    target_step: int | None = None
    staged: StagedSiblings = ()

    def staged_keys(self) -> list[str]:
        group_id = group_id_for(self.epoch, self.prompt_id)
        return [staged_key(group_id, index, version) for index, version in self.staged]


class PromptLedger:
    def __init__(self) -> None:
        self._entries: dict[str, LedgerEntry] = {}
        # Terminal entries of finished epochs are folded into these counts.
        self._pruned: Counter[PromptState] = Counter()

    def admit(self, epoch: int, prompt_id: int, target_step: int | None = None) -> str:
        """Record a new in-flight prompt; exactly-once per epoch is enforced here."""
        group_id = group_id_for(epoch, prompt_id)
        if group_id in self._entries:
            raise InvariantViolation(
                f"prompt {prompt_id} admitted twice in epoch {epoch} "
                f"(already {self._entries[group_id].state})"
            )
        self._entries[group_id] = LedgerEntry(epoch, prompt_id, PromptState.IN_FLIGHT, target_step=target_step)
        return group_id

    def advance(self, group_id: str, state: PromptState, reason: str = "") -> None:
        entry = self._entries.get(group_id)
        if entry is None:
            raise InvariantViolation(f"group {group_id} is not in the prompt ledger")
        if state not in _NEXT[entry.state]:
            raise InvariantViolation(f"group {group_id}: illegal ledger move {entry.state} -> {state}")
        self._entries[group_id] = replace(entry, state=state, reason=reason, staged=())

    def stage(self, group_id: str, index: int, weight_version: int) -> None:
        """A finished sibling of an in-flight group is in TQ's staging partition."""
        entry = self._entries.get(group_id)
        if entry is None or entry.state is not PromptState.IN_FLIGHT:
            raise InvariantViolation(f"sibling {index} staged for group {group_id} that is not in flight")
        if any(i == index for i, _ in entry.staged):
            raise InvariantViolation(f"sibling {index} of group {group_id} staged twice")
        self._entries[group_id] = replace(entry, staged=tuple(sorted((*entry.staged, (index, weight_version)))))

    def unstage(self, group_id: str, siblings: StagedSiblings) -> None:
        entry = self._entries[group_id]
        missing = set(siblings) - set(entry.staged)
        if missing:
            raise InvariantViolation(f"group {group_id}: siblings {sorted(missing)} are not staged")
        self._entries[group_id] = replace(entry, staged=tuple(s for s in entry.staged if s not in siblings))

    def staged_keys(self) -> set[str]:
        """Every staged sibling's TQ key: part of a cut's exact inventory."""
        return {key for e in self._entries.values() if e.staged for key in e.staged_keys()}

    def staged_count(self) -> int:
        """How many siblings are staged in TQ (only in-flight entries stage any)."""
        return sum(len(e.staged) for e in self._entries.values())

    def note_redispatch(self, group_id: str, reason: str) -> None:
        """An in-flight group goes to generation again (its last attempt was aborted); keep why."""
        entry = self._entries.get(group_id)
        if entry is None or entry.state is not PromptState.IN_FLIGHT:
            raise InvariantViolation(f"redispatch of group {group_id} that is not in flight")
        self._entries[group_id] = replace(entry, reason=reason)

    def requeue_after_shadow_restore(self, group_id: str) -> None:
        """READY -> IN_FLIGHT, only when a gated sampler's ready groups were not restored from TQ.

        Their prompts are generated again rather than lost; within the epoch they are
        still trained once, because the unrestored rows never reach the trainer.
        """
        entry = self._entries[group_id]
        if entry.state is not PromptState.READY:
            raise InvariantViolation(f"group {group_id}: cannot requeue from {entry.state}")
        self._entries[group_id] = replace(entry, state=PromptState.IN_FLIGHT)

    def retarget(self, group_id: str, target_step: int | None) -> None:
        self._entries[group_id] = replace(self._entries[group_id], target_step=target_step)

    def state_of(self, group_id: str) -> PromptState | None:
        entry = self._entries.get(group_id)
        return entry.state if entry else None

    def entry(self, group_id: str) -> LedgerEntry:
        return self._entries[group_id]

    def in_state(self, state: PromptState) -> list[str]:
        return [gid for gid, e in self._entries.items() if e.state is state]

    def counts(self) -> dict[str, int]:
        counts = Counter(self._pruned)
        counts.update(e.state for e in self._entries.values())
        return {state.value: counts[state] for state in PromptState}

    def prune_finished_epochs(self, current_epoch: int) -> None:
        """Fold terminal entries of epochs before ``current_epoch`` into counts.

        Keeps a week-long run's ledger bounded by about two epochs of entries.
        """
        for gid in [g for g, e in self._entries.items()
                    if e.epoch < current_epoch and not _NEXT[e.state]]:
            self._pruned[self._entries.pop(gid).state] += 1

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> dict[str, LedgerEntry]:
        return self._entries

    def copy(self) -> PromptLedger:
        """An independent ledger at this instant: entries are immutable, so copying the maps is enough."""
        ledger = PromptLedger()
        ledger._entries = dict(self._entries)
        ledger._pruned = Counter(self._pruned)
        return ledger

    def to_document(self) -> LedgerDocument:
        return LedgerDocument(
            entries=[LedgerEntryRecord(gid, e.epoch, e.prompt_id, e.state.value, e.reason, e.target_step,
                                       [list(s) for s in e.staged])
                     for gid, e in self._entries.items()],
            pruned={s.value: n for s, n in self._pruned.items()},
        )

    @classmethod
    def from_document(cls, document: LedgerDocument) -> PromptLedger:
        """A ledger from its bundle document; an unknown state raises ``ValueError``."""
        ledger = cls()
        for r in document.entries:
            if r.group_id != group_id_for(r.epoch, r.prompt_id) or r.group_id in ledger._entries:
                raise ValueError(f"ledger entry {r.group_id!r} is duplicated or not prompt {r.prompt_id} "
                                 f"of epoch {r.epoch}")
            state = PromptState(r.state)
            staged = tuple(sorted((index, version) for index, version in r.staged))
            if staged and state is not PromptState.IN_FLIGHT:
                raise ValueError(f"ledger entry {r.group_id!r} is {state} but lists staged siblings")
            if len({index for index, _ in staged}) != len(staged):
                raise ValueError(f"ledger entry {r.group_id!r} stages a sibling twice")
            ledger._entries[r.group_id] = LedgerEntry(r.epoch, r.prompt_id, state, r.reason, r.target_step, staged)
        for state, n in document.pruned.items():
            ledger._pruned[PromptState(state)] = n
        return ledger
