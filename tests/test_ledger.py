"""The prompt ledger never holds a prompt twice, and every admitted prompt is in flight or terminal."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scd.dataloader import DataloaderState, PromptOrder
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState, staged_key
from scd.schema import LedgerDocument, LedgerEntryRecord


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = PromptLedger()
        self.order = PromptOrder(5, DataloaderState(seed=3))
        self.admitted: list[str] = []
        self.terminal: dict[str, PromptState] = {}

    @rule()
    def admit(self) -> None:
        epoch, prompt_id = self.order.take()
        self.admitted.append(self.ledger.admit(epoch, prompt_id))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), target_state=st.sampled_from(list(PromptState)))
    def advance(self, data: st.DataObject, target_state: PromptState) -> None:
        gid = data.draw(st.sampled_from(self.admitted))
        current = self.ledger.state_of(gid)
        legal = {PromptState.IN_FLIGHT: {PromptState.READY, PromptState.DROPPED, PromptState.FILTERED},
                 PromptState.READY: {PromptState.CONSUMED, PromptState.DROPPED}}.get(current, set())
        if target_state in legal:
            self.ledger.advance(gid, target_state, "stale" if target_state is PromptState.DROPPED else "")
            if target_state in (PromptState.CONSUMED, PromptState.DROPPED, PromptState.FILTERED):
                self.terminal[gid] = target_state
        else:
            with pytest.raises(InvariantViolation):
                self.ledger.advance(gid, target_state)

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def readmit_in_same_epoch_fails(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self.admitted))
        if gid in self.ledger.entries():
            entry = self.ledger.entry(gid)
            with pytest.raises(InvariantViolation):
                self.ledger.admit(entry.epoch, entry.prompt_id)

    @rule()
    def prune(self) -> None:
        self.ledger.prune_finished_epochs(self.order.state.epoch)

    @invariant()
    def every_admitted_prompt_is_accounted_for(self) -> None:
        counts = self.ledger.counts()
        assert sum(counts.values()) == len(self.admitted) == len(set(self.admitted))
        assert counts["consumed"] + counts["dropped"] + counts["filtered"] == len(self.terminal)
        for gid in self.admitted:
            state = self.ledger.state_of(gid)
            assert state is not None or gid in self.terminal


TestLedger = LedgerMachine.TestCase


def test_ledger_round_trips_through_its_bundle_document() -> None:
    ledger = PromptLedger()
    a = ledger.admit(0, 3)
    ledger.admit(0, 4)
    ledger.advance(a, PromptState.READY)
    ledger.advance(a, PromptState.DROPPED, "stale")
    encoded = msgspec.json.encode(ledger.to_document())
    again = PromptLedger.from_document(msgspec.json.decode(encoded, type=LedgerDocument))
    assert again.counts() == ledger.counts()
    assert again.entry(a).reason == "stale"


def test_each_epoch_visits_every_prompt_once() -> None:
    order = PromptOrder(7, DataloaderState(seed=11))
    seen = [order.take() for _ in range(21)]
    for epoch in range(3):
        assert sorted(p for e, p in seen if e == epoch) == list(range(7))
    assert [p for e, p in seen if e == 0] != [p for e, p in seen if e == 1]


def test_staged_siblings_are_kept_per_in_flight_entry_and_dropped_when_it_moves_on() -> None:
    ledger = PromptLedger()
    gid = ledger.admit(0, 3)
    ledger.stage(gid, 5, 2)
    ledger.stage(gid, 1, 2)
    assert ledger.entry(gid).staged == ((1, 2), (5, 2))
    assert ledger.staged_keys() == {staged_key(gid, 1, 2), staged_key(gid, 5, 2)} == {"e0-p3/1/v2", "e0-p3/5/v2"}
    with pytest.raises(InvariantViolation, match="staged twice"):
        ledger.stage(gid, 5, 3)
    copy = ledger.copy()
    ledger.unstage(gid, ((5, 2),))
    assert ledger.entry(gid).staged == ((1, 2),) and copy.entry(gid).staged == ((1, 2), (5, 2))
    with pytest.raises(InvariantViolation, match="not staged"):
        ledger.unstage(gid, ((5, 2),))
    document = msgspec.json.decode(msgspec.json.encode(copy.to_document()), type=LedgerDocument)
    assert PromptLedger.from_document(document).entry(gid).staged == ((1, 2), (5, 2))
    # The group committed: its siblings live in the group's value now.
    ledger.advance(gid, PromptState.READY)
    assert ledger.entry(gid).staged == () and ledger.staged_keys() == set()
    with pytest.raises(InvariantViolation, match="not in flight"):
        ledger.stage(gid, 0, 2)


def test_a_ledger_document_with_staged_siblings_outside_flight_is_refused() -> None:
    ready = LedgerEntryRecord("e0-p1", 0, 1, "ready", "", None, [[0, 1]])
    with pytest.raises(ValueError, match="lists staged siblings"):
        PromptLedger.from_document(LedgerDocument(entries=[ready], pruned={}))
    twice = LedgerEntryRecord("e0-p1", 0, 1, "in_flight", "", None, [[0, 1], [0, 2]])
    with pytest.raises(ValueError, match="stages a sibling twice"):
        PromptLedger.from_document(LedgerDocument(entries=[twice], pruned={}))
    # A schema 3 entry (no staged field) reads as one with none staged.
    (old,) = msgspec.json.decode(b'[["e0-p1", 0, 1, "in_flight", "", null]]', type=list[LedgerEntryRecord])
    assert PromptLedger.from_document(LedgerDocument(entries=[old], pruned={})).entry("e0-p1").staged == ()
