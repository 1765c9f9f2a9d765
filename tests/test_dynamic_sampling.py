"""Dynamic sampling (``async_rl.drop_zero_variance_groups``): a complete group whose rewards are all equal is
filtered, never committed nor trained, its prompt done for the epoch, and admission refills so every step still
trains ``groups_per_step`` groups.  The decision is exact; the run is the controller in-process on the session's
real TQ (the synthetic engine, a reward that is constant for some prompts)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import anyio
import pytest
from prometheus_client import REGISTRY

from scd.config import Config
from scd.daemon import Controller
from scd.dataloader import DataloaderState, PromptOrder
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.rollouts import has_zero_variance
from scd.skew import Fate
from scd.tasks import build_task
from scd.triggers import Triggers
from tests.conftest import tiny_config
from tests.test_daemon import read_events

# Constant for the prompts whose answer starts with 0, 1 or 2 (about 3 in 10), whatever the completion: those
# groups carry no signal.  Every other prompt's siblings get distinct rewards.
CONSTANT_FOR_SOME_PROMPTS = """
import random

def reward(prompt, completion, answer, row):
    return 1.0 if answer[0] in "012" else random.random()
"""


def constant_prompt(answer: str) -> bool:
    return answer[0] in "012"


@pytest.mark.parametrize(("rewards", "zero"), [
    ([1.0] * 8, True),
    ([0.0] * 8, True),
    ([-0.0, 0.0], True),  # equal as numbers: the same advantages (all 0)
    ([0.5], True),  # a group of one has no variance (config refuses generation.group_size < 2 anyway)
    ([1.0] * 7 + [0.0], False),
    ([0.0, 0.0, 1e-12], False),  # any difference at all ranks the completions: kept
    ([0.1 + 0.2, 0.3], False),  # not a tolerance: 0.30000000000000004 != 0.3
])
def test_the_zero_variance_decision_is_exact(rewards: list[float], zero: bool) -> None:
    assert has_zero_variance(rewards) is zero


def test_filtered_is_a_terminal_ledger_state_reached_only_from_in_flight() -> None:
    ledger = PromptLedger()
    filtered, ready = ledger.admit(0, 1), ledger.admit(0, 2)
    ledger.advance(filtered, PromptState.FILTERED)
    ledger.advance(ready, PromptState.READY)
    with pytest.raises(InvariantViolation, match="illegal ledger move ready -> filtered"):
        ledger.advance(ready, PromptState.FILTERED)
    for later in PromptState:
        with pytest.raises(InvariantViolation, match="illegal ledger move filtered"):
            ledger.advance(filtered, later)
    with pytest.raises(InvariantViolation, match="admitted twice in epoch 0"):
        ledger.admit(0, 1)  # never retried within its epoch
    restored = PromptLedger.from_document(ledger.to_document())
    assert restored.state_of(filtered) is PromptState.FILTERED
    restored.prune_finished_epochs(1)  # done for epoch 0: folded into the counts like a consumed prompt
    assert restored.state_of(filtered) is None and restored.counts()["filtered"] == 1
    assert restored.state_of(ready) is PromptState.READY


def filtering_config(tmp_path: Path, partition: str, prompts: int, reward_module: str, sampler: str) -> Config:
    """configs/tiny.toml on the synthetic engine, ``prompts`` prompts scored by ``reward_module``'s ``reward``, with
    dynamic sampling on."""
    (tmp_path / "constant_reward.py").write_text(reward_module)
    return tiny_config(tmp_path, partition, task={"size": prompts, "rewards": [{"function": "constant_reward:reward"}]},
                       generation={"backend": "synthetic", "synthetic": {"tokens_per_s": 20_000.0,
                                                                         "min_completion_tokens": 1,
                                                                         "max_completion_tokens": 4}},
                       async_rl={"drop_zero_variance_groups": True, "sampler": {"name": sampler}})


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.parametrize("sampler", ["windowed", "weight_fifo", "in_order"])
async def test_zero_variance_groups_are_filtered_once_per_epoch_and_every_step_trains_a_full_batch(
        tmp_path: Path, partition: str, sampler: str) -> None:
    prompts = 64
    config = filtering_config(tmp_path, partition, prompts, CONSTANT_FOR_SOME_PROMPTS, sampler)
    constant = {p.prompt_id for p in build_task(config.task) if constant_prompt(p.answer)}
    assert 0 < len(constant) < prompts // 2
    steps, per_step = 12, config.trainer.groups_per_step  # past four epochs of 64 prompts: epochs end
    filtered_before = sample("scd_groups_filtered_total")
    filtered_tokens_before = sample("scd_generation_filtered_tokens_total")
    async with Controller.open(config, config_dir=tmp_path) as controller:
        await controller.run(max_steps=steps)
        state, rollouts = controller.state, controller.rollouts.statistics()
        counts, entries = state.ledger.counts(), dict(state.ledger.entries())
        fates = {fate: sum(c[fate.value] for c in state.fates.counts().values()) for fate in Fate}
        dataloader, stats = state.order.state, state.statistics()
        await controller.dataplane.clear_all()

    events = [e for e in read_events(Path(config.telemetry.events_path)) if e["event"] == "train_step"]
    assert [e["step"] for e in events] == list(range(1, steps + 1))
    # Every step trains a full batch, never a filtered group, and no prompt twice in an epoch.
    assert all(len(e["prompt_ids"]) == per_step for e in events)
    trained = [tuple(p) for e in events for p in e["prompt_ids"]]
    assert len(trained) == len(set(trained)) == steps * per_step
    assert not {prompt_id for _, prompt_id in trained} & constant, "a zero-variance group was trained"
    # Each admitted prompt has one fate in the ledger: every constant prompt admitted is filtered exactly once
    # (or still in flight at the end), no other prompt is.
    admitted = dataloader.epoch * prompts + dataloader.cursor
    assert sum(counts.values()) == admitted == fates[Fate.ADMITTED]
    assert dataloader.epoch >= 4
    ranks = PromptOrder(prompts, DataloaderState(seed=config.task.seed)).ranks(dataloader.epoch)
    constant_admitted = dataloader.epoch * len(constant) + sum(ranks[p] < dataloader.cursor for p in constant)
    in_flight_constant = sum(e.state is PromptState.IN_FLIGHT and e.prompt_id in constant for e in entries.values())
    assert counts["filtered"] + in_flight_constant == constant_admitted
    assert all(e.prompt_id in constant for e in entries.values() if e.state is PromptState.FILTERED)
    assert all(e.prompt_id not in constant for e in entries.values()
               if e.state in (PromptState.READY, PromptState.CONSUMED, PromptState.DROPPED))
    # The fates and the ledger agree; the metric counts each filtered group once.
    assert fates[Fate.FILTERED] == counts["filtered"] == stats.filtered_groups
    assert fates[Fate.TRAINED] == counts["consumed"] == steps * per_step
    assert sample("scd_groups_filtered_total") - filtered_before == counts["filtered"]
    # Goodput: the filtered groups' tokens are a row of their own, not waste.
    assert rollouts.filtered_tokens > 0
    assert sample("scd_generation_filtered_tokens_total") - filtered_tokens_before == rollouts.filtered_tokens
    assert 0 < events[-1]["run_filtered_tokens"] <= rollouts.filtered_tokens
    assert events[-1]["run_wasted_tokens"] <= rollouts.wasted_tokens
    print(f"{sampler}: {admitted} admitted over {dataloader.epoch} epochs, {counts['filtered']} filtered "
          f"({rollouts.filtered_tokens} tokens), {counts['consumed']} trained, {counts['dropped']} dropped stale")


async def test_an_epoch_of_groups_all_filtered_is_logged_and_the_run_goes_on(
        tmp_path: Path, partition: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reward that is constant for every prompt (all 0 at the start of a hard task) fills no step: the operator
    is told once an epoch's worth of groups in a row were filtered, and again after each further epoch's worth."""
    prompts = 16
    config = filtering_config(tmp_path, partition, prompts, "def reward(prompt, completion, answer, row):\n"
                                                            "    return 0.0\n", "windowed")
    warning = f"the last {2 * prompts} complete groups, an epoch's worth of prompts, were all filtered"
    caplog.set_level(logging.WARNING, logger="scd.rollouts")
    async with Controller.open(config, config_dir=tmp_path) as controller:
        async with anyio.create_task_group() as running:
            running.start_soon(controller.run, Triggers(), 1)
            with anyio.fail_after(120):
                while warning not in caplog.text:
                    await anyio.sleep(0.05)
            running.cancel_scope.cancel()
        state = controller.state
        filtered = state.ledger.counts()["filtered"]
        assert state.trainer_step == state.committed_groups == 0 and filtered >= 2 * prompts
        await controller.dataplane.clear_all()
    warned_at = [int(n) for n in re.findall(r"the last (\d+) complete groups", caplog.text)]
    assert warned_at == [prompts * (i + 1) for i in range(filtered // prompts)]
