"""The controller in-process on the session's real TQ: it learns, and its books balance."""

from __future__ import annotations

from pathlib import Path

import orjson

from scd.daemon import Controller
from scd.ledger import PromptState
from tests.conftest import tiny_config


def read_events(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_text().splitlines()]


async def test_reward_rises_and_the_books_balance(tmp_path: Path, partition: str) -> None:
    config = tiny_config(tmp_path, partition)
    steps = 110
    async with Controller.open(config) as controller:
        await controller.run(max_steps=steps)
        stats = controller.state.statistics()
        tq_ids = await controller.dataplane.list_keys()
        replay_ids = controller.state.replay.keys()
        ledger = controller.state.ledger

    assert stats.trainer_step == stats.weight_version == steps
    # Exact inventory: TQ holds precisely the ready groups.
    assert tq_ids == replay_ids
    counts = ledger.counts()
    assert counts["consumed"] == steps * config.trainer.groups_per_step
    assert counts["ready"] == stats.replay_groups
    assert counts["in_flight"] == stats.in_flight
    assert counts["dropped"] == stats.evicted_stale
    assert all(e.state is not PromptState.DROPPED or e.reason == "stale" for e in ledger.entries().values())

    events = [e for e in read_events(Path(config.telemetry.events_path)) if e["event"] == "train_step"]
    assert [e["step"] for e in events] == list(range(1, steps + 1))
    consumed = [tuple(p) for e in events for p in e["prompt_ids"]]
    assert len(consumed) == len(set(consumed)), "a prompt was trained twice in one epoch"
    first = sum(e["reward_mean"] for e in events[:10]) / 10
    last = sum(e["reward_mean"] for e in events[-10:]) / 10
    print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.15
    assert last > first + 0.3, (first, last)
