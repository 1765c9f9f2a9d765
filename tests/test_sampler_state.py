"""A restored sampler document is checked against the ledger by the sampler that reads it (pure logic).

Hand-made documents and ledger views: each inconsistent one is refused as an invariant violation
naming its field, never with a KeyError, ValueError or TypeError; a document counted in another
``groups_per_step`` is re-derived into one that checks, and from which every step fills.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scd.config import Config, parse_config
from scd.errors import InvariantViolation
from scd.samplers import (
    BUILTIN_SAMPLERS,
    DispatchedGroup,
    DispatchView,
    InOrderSampler,
    SamplerStateError,
    WeightFifoSampler,
    WindowedSampler,
    gates_dispatch,
)


def view(step: int, *targets: int | None) -> DispatchView:
    """Dispatched groups (in flight or ready) with these target steps, at trainer step ``step``."""
    return DispatchView(step, tuple(DispatchedGroup(f"e0-p{i}", target) for i, target in enumerate(targets)))


# in_order at step 3, 2 per step, window 1: steps 3 and 4 dispatched whole (the bundle a real run leaves).
IN_ORDER_VIEW = view(3, 3, 3, 4, 4)
IN_ORDER_STATE: dict[str, Any] = {"dispatched": 10, "refill": [], "groups_per_step": 2}
# weight_fifo at step 3, 2 per step: 4 groups dispatched beyond the 6 trained.
FIFO_VIEW = view(3, None, None, None, None)
FIFO_STATE: dict[str, Any] = {"dispatched": 10, "groups_per_step": 2}


def test_the_documents_a_real_run_leaves_are_accepted() -> None:
    InOrderSampler(1, 2).check_state(IN_ORDER_STATE, IN_ORDER_VIEW)
    InOrderSampler(1, 2).check_state({"dispatched": 10, "refill": [3, 4], "groups_per_step": 2},
                                     view(3, 3, 4))  # a step-3 and a step-4 group evicted, to be refilled
    WeightFifoSampler(1, 2).check_state(FIFO_STATE, FIFO_VIEW)
    WindowedSampler(1, 2).check_state({"dispatched": 17}, view(3, None, None))


def changed(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**base, **fields}


def without(base: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != field}


REFUSED: list[tuple[str, Any, dict[str, Any], DispatchView, str]] = [
    ("in_order", InOrderSampler, without(IN_ORDER_STATE, "dispatched"), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, without(IN_ORDER_STATE, "refill"), IN_ORDER_VIEW, "refill"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched="10"), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=None), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=True), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=-4), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=10.5), IN_ORDER_VIEW, "dispatched"),
    # More dispatched than the ledger holds: step 5 would wait for groups that do not exist.
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=12), IN_ORDER_VIEW, "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=10 ** 12), IN_ORDER_VIEW, "dispatched"),
    # Fewer steps dispatched than trained.
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, dispatched=4), view(3), "dispatched"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=5), IN_ORDER_VIEW, "refill"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=["3"]), IN_ORDER_VIEW, "refill"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=[-1]), IN_ORDER_VIEW, "refill"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=[4, 3]), view(3, 4, 3), "refill"),
    # A refill of a step already trained: its group would wait for ever.
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=[2]), view(3, 3, 3, 4), "refill"),
    # Step 4 would get three groups: two in the ledger and a refill.
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, refill=[4]), IN_ORDER_VIEW, "refill"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, groups_per_step=0), IN_ORDER_VIEW, "groups_per_step"),
    ("in_order", InOrderSampler, changed(IN_ORDER_STATE, quota=3), IN_ORDER_VIEW, "quota"),
    # The ledger's side: a dispatched group with no target step, or one before the trainer's step.
    ("in_order", InOrderSampler, IN_ORDER_STATE, view(3, 3, None, 4, 4), "target_step"),
    ("in_order", InOrderSampler, IN_ORDER_STATE, view(3, 3, 3, 4, 2), "target_step"),
    ("weight_fifo", WeightFifoSampler, without(FIFO_STATE, "dispatched"), FIFO_VIEW, "dispatched"),
    ("weight_fifo", WeightFifoSampler, changed(FIFO_STATE, dispatched=-2), FIFO_VIEW, "dispatched"),
    ("weight_fifo", WeightFifoSampler, changed(FIFO_STATE, dispatched="x"), FIFO_VIEW, "dispatched"),
    # A quota the ledger cannot account for: it would dispatch too few (or too many) groups.
    ("weight_fifo", WeightFifoSampler, changed(FIFO_STATE, dispatched=14), FIFO_VIEW, "dispatched"),
    ("weight_fifo", WeightFifoSampler, changed(FIFO_STATE, refill=[]), FIFO_VIEW, "refill"),
    ("weight_fifo", WeightFifoSampler, changed(FIFO_STATE, groups_per_step="2"), FIFO_VIEW, "groups_per_step"),
    ("windowed", WindowedSampler, {}, FIFO_VIEW, "dispatched"),
    ("windowed", WindowedSampler, {"dispatched": -1}, FIFO_VIEW, "dispatched"),
    ("windowed", WindowedSampler, {"dispatched": 3, "refill": []}, FIFO_VIEW, "refill"),
]


@pytest.mark.parametrize(("name", "cls", "state", "dispatch", "field"), REFUSED,
                         ids=[f"{r[0]}: {r[4]} #{i}" for i, r in enumerate(REFUSED)])
def test_an_inconsistent_sampler_document_is_refused_naming_its_field(
    name: str, cls: Any, state: dict[str, Any], dispatch: DispatchView, field: str
) -> None:
    sampler = cls(1, 2)
    assert sampler.name == name
    for check in (sampler.check_state, sampler.restore_dispatch):
        # SamplerStateError only: a KeyError, ValueError or TypeError escaping would fail the test.
        with pytest.raises(SamplerStateError) as refused:
            check(state, dispatch)
        assert refused.value.field == field
        assert isinstance(refused.value, InvariantViolation) and refused.value.exit_code == 3
        assert f"sampler state field {field!r}" in str(refused.value)


def fill_steps(sampler: Any, dispatch: DispatchView, steps: int) -> None:
    """Generate, train and dispatch on from a restored state: every step must fill with exactly its groups."""
    ready = [g.target_step for g in dispatch.live]
    for step in range(dispatch.trainer_step, dispatch.trainer_step + steps):
        while sampler.may_dispatch(step):
            ready.append(sampler.on_dispatch())
        if sampler.name == "in_order":
            assert ready.count(step) == sampler.groups_per_step, (step, ready)
            ready = [t for t in ready if t != step]
        else:
            assert len(ready) >= sampler.groups_per_step, (step, ready)
            ready = ready[sampler.groups_per_step:]


@pytest.mark.parametrize("name", ["in_order", "weight_fifo"])
@pytest.mark.parametrize("groups_per_step", [1, 3, 4])
def test_a_document_counted_in_another_groups_per_step_is_rederived_so_every_step_fills(
    name: str, groups_per_step: int
) -> None:
    old_state, old_view = (IN_ORDER_STATE, IN_ORDER_VIEW) if name == "in_order" else (FIFO_STATE, FIFO_VIEW)
    sampler = BUILTIN_SAMPLERS[name](1, groups_per_step)
    retargets = sampler.restore_dispatch(old_state, old_view)
    new_view = DispatchView(old_view.trainer_step, tuple(
        DispatchedGroup(g.group_id, retargets.get(g.group_id, g.target_step)) for g in old_view.live))
    # What the restore installed is what the next checkpoint saves: it checks with no re-derivation.
    saved = sampler.state()
    assert saved["groups_per_step"] == groups_per_step
    BUILTIN_SAMPLERS[name](1, groups_per_step).check_state(saved, new_view)
    if name == "in_order":
        # The ledger's order of target steps is kept; the first step starts at the trainer's step.
        targets = [t for _, t in sorted((old.target_step, new.target_step)
                                        for old, new in zip(old_view.live, new_view.live, strict=True))]
        assert targets == sorted(targets) and targets[0] == old_view.trainer_step
    else:
        assert retargets == {}
    fill_steps(sampler, new_view, 6)


def test_a_document_from_before_groups_per_step_was_recorded_is_rederived() -> None:
    """Bundles written before the document recorded it (their fingerprint differs too: restored only
    with --allow-config-change) are re-derived rather than trusted."""
    sampler = InOrderSampler(1, 2)
    assert sampler.restore_dispatch({"dispatched": 10, "refill": []}, IN_ORDER_VIEW) == {}
    assert sampler.state() == IN_ORDER_STATE


@pytest.mark.parametrize("name", sorted(BUILTIN_SAMPLERS))
def test_groups_per_step_is_in_the_fingerprint_exactly_when_the_sampler_gates_dispatch(
    tmp_path: Path, name: str
) -> None:
    def config(groups_per_step: int) -> Config:
        return parse_config({"async_rl": {"sampler": {"name": name}},
                             "trainer": {"groups_per_step": groups_per_step}}, tmp_path)

    gated = gates_dispatch(BUILTIN_SAMPLERS[name])
    assert ("trainer.groups_per_step" in config(2).fingerprint_fields()) == gated
    assert (config(2).fingerprint() != config(4).fingerprint()) == gated
