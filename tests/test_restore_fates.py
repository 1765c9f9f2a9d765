"""A restore after a crash counts a prompt ``lost_to_crash`` only when its work was lost: one in flight in the
bundle with every sibling kept (staged, or finished in the cut) is committed and trained as it was, and
counts nothing (the synthetic engine, a slow reward, the session's real TQ)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import orjson

from scd.checkpoint import layout
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.ledger import PromptState
from scd.skew import Fate
from scd.triggers import Triggers
from tests.conftest import tiny_config

# Slower than generation: complete groups wait for their scores, in flight, at any cut.
SLOW_REWARD = """
import time

def reward(prompt, completion, answer, row):
    time.sleep(0.02)
    return 0.0
"""


async def polled(check: Callable[[], object], timeout: float = 120) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.01)


def fates_total(controller: Controller, fate: Fate) -> int:
    return sum(counts[fate.value] for counts in controller.state.fates.counts().values())


async def test_a_prompt_whose_siblings_the_crash_bundle_kept_whole_is_not_counted_lost_to_the_crash(
        tmp_path: Path, partition: str) -> None:
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    config = tiny_config(tmp_path, partition, task={"rewards": [{"function": "slow_reward:reward"}],
                                                    "reward_workers": 1},
                         generation={"backend": "synthetic", "synthetic": {"tokens_per_s": 20_000.0,
                                                                           "min_completion_tokens": 1,
                                                                           "max_completion_tokens": 4}},
                         checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600})
    # Run, checkpoint once a group waits in flight for its scores, and stop dead (no final bundle; TQ lost).
    async with Controller.open(config, config_dir=tmp_path) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()
        async with anyio.create_task_group() as running:
            running.start_soon(controller.run, triggers, 1_000_000)
            rollouts, state = controller.rollouts, controller.state
            await polled(lambda: state.trainer_step >= 1 and rollouts.statistics().awaiting_scores)
            triggers.request_checkpoint()
            await polled(lambda: checkpointer.statistics().completed)
            running.cancel_scope.cancel()
    await DataPlane(config.data_plane).clear_all()
    (bundle,) = layout.finalized_bundles(tmp_path / "checkpoints")

    async with Controller.open(config, config_dir=tmp_path) as controller:
        report = await controller.restore()
        assert report is not None and report.bundle == bundle
        in_flight = len(controller.state.ledger.in_state(PromptState.IN_FLIGHT))
        kept_whole = in_flight - report.prompts_redispatched
        assert kept_whole > 0, "no in-flight group of the bundle had every sibling kept"
        # Only those generation runs for again lost anything to the crash.
        lost_before = sum(counts[Fate.LOST_TO_CRASH] for counts in orjson.loads(
            (bundle / layout.SIDECAR_FILE).read_bytes())["prompt_fates"].values())
        assert fates_total(controller, Fate.LOST_TO_CRASH) - lost_before == report.prompts_redispatched
        await controller.dataplane.clear_all()
