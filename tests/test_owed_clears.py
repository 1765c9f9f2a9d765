"""A clear owed at the close of a TQ save window fails after a good save: the bundle is kept, the clear stays owed.

Real TQ on the session's Ray, a real controller and real files; the failing clear is the
``during_deferred_clear`` fault point (ENOSPC), armed in this process.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from scd.daemon import Controller
from scd.ledger import staged_key
from scd.schema import Outcome
from tests.support.configs import config_for
from tests.support.scores import ZERO_SCORES
from tests.support.tq import clear_partition
from tests.test_data_safety import WAIT_S, checkpoint_now, generated, metric

FAILING_CLEAR = "during_deferred_clear=enospc"


async def test_a_deferred_clear_that_fails_after_a_good_save_keeps_the_bundle_and_is_retried(
    tmp_path: Path, partition: str
) -> None:
    root = tmp_path / "checkpoints"
    async with Controller.open(config_for(root, partition)) as controller:
        state, dp, checkpointer = controller.state, controller.dataplane, controller.checkpointer
        assert checkpointer is not None
        (result,) = await generated(controller, 1)
        group_id, first = result.request.group_id, result.completions[0]
        # A sibling staged while its group still ran: the group's commit owes the staged key's clear,
        # and the checkpoint's save window closes with it still owed.
        await state.stage_siblings([(group_id, 0, first)])
        staged = staged_key(group_id, 0, first.weight_version)
        await controller.rollouts.commit(result, ZERO_SCORES)
        assert await dp.list_keys() == {group_id, staged}
        assert metric("scd_owed_clears") == 1
        failures = metric("scd_owed_clear_failures_total")

        with faults.armed(FAILING_CLEAR):
            assert await checkpoint_now(controller) is Outcome.COMPLETED
        verified = verify_bundle(layout.step_dir(root, 0))
        assert {g.group_id for g in verified.sidecar.groups} == {group_id}
        assert staged in verified.sidecar.uncut_keys  # in TQ's snapshot, not the cut's: restore clears it
        assert checkpointer.statistics().consecutive_failures == 0 and controller.watch.health_problem() == ""
        assert metric("scd_owed_clear_failures_total") == failures + 1
        assert metric("scd_owed_clears") == 1
        assert await dp.list_keys() == {group_id, staged}  # owed still, not forgotten

        # The next clear (the group trained and consumed) carries the owed one with it.
        await state.finish_step(state.replay.groups())
        assert await dp.list_keys() == set()
        assert metric("scd_owed_clears") == 0

        # The run goes on, and its last checkpoint, whose deferred clear fails too, is kept: exit 0.
        with faults.armed(FAILING_CLEAR), anyio.fail_after(WAIT_S * 4):
            await controller.run(max_steps=3)
        assert state.trainer_step == 3
        assert metric("scd_owed_clear_failures_total") == failures + 2
    assert [layout.step_of(b) for b in layout.finalized_bundles(root)] == [0, 3]
    verify_bundle(layout.step_dir(root, 3))
    await clear_partition(partition)
