"""The controller in-process on the session's real TQ: it learns, and its books balance."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import anyio
import orjson
import pytest
import torch

from scd.barrier import CheckpointBarrier
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.ledger import PromptState
from scd.model.policy import build_policy
from scd.model.prompts import render_task
from scd.rewards import load_rewards
from scd.rollouts import Rollouts
from scd.samplers import build_sampler
from scd.state import ControllerState
from scd.training.grpo import GRPOTrainer
from scd.triggers import Triggers
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
    steps_trained = [e for e in events if e["trained_tokens"] > 0 and 0 <= e["clip_fraction"] <= 1]
    assert len(steps_trained) == steps
    # Measured on every step though configs/tiny.toml has no entropy bonus: a sampling policy's is above 0.
    assert config.trainer.entropy_coef == 0 and all(e["entropy"] > 0 for e in events)
    # The default reward is the character match, through the scoring stage, reported as a component.
    assert all(e["reward_components"]["match"] == pytest.approx(e["reward_mean"]) for e in events)
    # The trainer's rate and importance ratios by staleness reach every step's event (a constant lr here).
    assert all(e["lr"] == config.trainer.lr and any(key.endswith("/mean") for key in e["is_ratio"])
               and e["behaviour_kl"].keys() == {key.split("/")[0] for key in e["is_ratio"]} for e in events)


async def test_systemd_hears_ready_and_stopping_once_through_a_drain(
        tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain and the end of training both stop serving; systemd is told STOPPING=1 once."""
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(address))
        listener.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(address))
        async with Controller.open(tiny_config(tmp_path, partition)) as controller:
            triggers = Triggers()
            async with anyio.create_task_group() as tg:
                tg.start_soon(controller.run, triggers, 10_000)
                while controller.state.trainer_step < 2:
                    await anyio.sleep(0.01)
                triggers.shutdown.set()
        messages = []
        while True:
            try:
                messages.append(listener.recv(4096).decode())
            except BlockingIOError:
                break
    assert messages.count("READY=1") == 1 and messages.count("STOPPING=1") == 1, messages
    assert messages.index("READY=1") < messages.index("STOPPING=1")


def test_statistics_records_are_frozen(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "no-tq-needed")
    policy = build_policy(config.model, config.run.seed)
    state = ControllerState(4, 0, build_sampler(config), DataPlane(config.data_plane), CheckpointBarrier())
    rollouts = Rollouts(config, state, policy, render_task(config, policy).prompts,
                        load_rewards(config.task, tmp_path), lambda: None)
    for record in (state.statistics(), state.barrier.statistics(), rollouts.statistics()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.__setattr__(dataclasses.fields(record)[0].name, 1)


def test_the_trainer_loads_the_state_it_copied(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "no-tq-needed")
    policy = build_policy(config.model, config.run.seed)
    trained, fresh = GRPOTrainer(config, policy), GRPOTrainer(config, policy)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.5)
    trained.optimizer.step()  # an optimizer state to carry
    model, optimizer = trained.state_copy()
    fresh.load_state(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(trained.model.state_dict().values(),
                                                 fresh.model.state_dict().values(), strict=True))
    assert fresh.optimizer.state_dict()["param_groups"] == trained.optimizer.state_dict()["param_groups"]


def test_a_restored_optimizer_takes_the_configured_settings_and_says_which_changed(tmp_path: Path) -> None:
    """lr changed 1e-3 -> 5e-4 before a restart was silently ignored (the bundle's param_groups)."""
    config = tiny_config(tmp_path, "no-tq-needed")
    saved = GRPOTrainer(config, build_policy(config.model, config.run.seed))
    saved.optimizer.step()
    saved.capture_state().write(tmp_path / "model.pt", tmp_path / "optimizer.pt")
    changed = tiny_config(tmp_path, "no-tq-needed", trainer={"lr": 5e-4, "weight_decay": 0.01})
    restored = GRPOTrainer(changed, build_policy(changed.model, changed.run.seed))
    changes = restored.load_state_files(tmp_path / "model.pt", tmp_path / "optimizer.pt")
    assert changes == {"trainer.lr": [config.trainer.lr, 5e-4], "trainer.weight_decay": [0.0, 0.01]}
    assert all(g["lr"] == 5e-4 and g["weight_decay"] == 0.01 for g in restored.optimizer.param_groups)
    same = GRPOTrainer(config, build_policy(config.model, config.run.seed))
    assert same.load_state_files(tmp_path / "model.pt", tmp_path / "optimizer.pt") == {}


SHORT_RUNS = 60


async def test_many_short_runs_each_end_cleanly(tmp_path: Path, partition: str) -> None:
    """A run's end cancels generation while siblings keep finishing: none of them may reach the
    stopped committer and turn a clean end (its final bundle written) into a failure."""
    config = tiny_config(
        tmp_path, partition, checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600},
        generation={"backend": "synthetic", "max_inflight_prompts": 16, "max_new_tokens": 12,
                    "synthetic": {"tokens_per_s": 20_000.0, "min_completion_tokens": 1, "max_completion_tokens": 12,
                                  "batch_groups": 4, "max_concurrent_batches": 4}})
    async with Controller.open(config) as controller:
        for _ in range(SHORT_RUNS):
            with anyio.fail_after(60):  # a run that cannot take its one step has stalled
                await controller.run(max_steps=controller.state.trainer_step + 1)
        assert controller.checkpointer is not None
        stats = controller.checkpointer.statistics()
    assert controller.state.trainer_step == SHORT_RUNS
    assert (stats.completed, stats.failed) == (SHORT_RUNS, 0)
