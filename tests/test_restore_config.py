"""A bundle against a changed config: refused before anything expensive starts, naming every changed key.

Real `scd` subprocesses and the bundles they write; the unit test of the settings' diff is pure logic.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from scd.checkpoint import layout
from scd.config import NOT_SET, Config, parse_config
from scd.schema import Sidecar, decode
from scd.training.schedule import lr_factor
from tests.conftest import REPO, SCD, ScdProcess, free_port, write_config
from tests.support.reward_server import RewardService


def events_in(directory: Path) -> list[dict[str, Any]]:
    path = directory / "out" / "events.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_fingerprint_changes_name_each_nested_key_with_its_old_and_new_value(tmp_path: Path) -> None:
    before = parse_config({"task": {"rewards": [{"function": "exact"}, {"function": "match", "weight": 0.5}]}},
                          tmp_path)
    after = parse_config({"task": {"seed": 3, "rewards": [{"function": "exact", "weight": 2.0}]},
                          "model": {"d_model": 32}}, tmp_path)
    saved = orjson.loads(orjson.dumps(before.fingerprint_fields()))  # as a bundle's training_info holds them

    assert after.fingerprint_changes(saved) == {
        "model.d_model": (64, 32),
        "task.rewards[0].weight": (1.0, 2.0),
        "task.rewards[1].function": ("match", NOT_SET),
        "task.rewards[1].name": ("", NOT_SET),
        "task.rewards[1].weight": (0.5, NOT_SET),
        "task.seed": (0, 3),
    }
    assert before.fingerprint_changes(saved) == {}


def test_training_changes_name_each_changed_setting_and_a_bundle_from_before_them_reads_as_the_defaults(
        tmp_path: Path) -> None:
    before = parse_config({}, tmp_path)
    after = parse_config({"trainer": {"lr_schedule": "cosine", "loss": {"clip_high": 0.28}},
                          "async_rl": {"drop_zero_variance_groups": True}}, tmp_path)
    saved = orjson.loads(orjson.dumps(before.training_settings()))  # as a bundle's training_info holds them

    # A decaying schedule's horizon counts too: a constant one has none.
    changes = {"trainer.loss.clip_high": (0.2, 0.28), "trainer.lr_schedule": ("constant", "cosine"),
               "run.max_steps": (NOT_SET, 300), "async_rl.drop_zero_variance_groups": (False, True)}
    assert after.training_changes(saved) == changes
    assert after.training_changes({}) == changes  # a bundle written before they were recorded: the defaults
    assert before.training_changes(saved) == before.training_changes({}) == {}
    longer = parse_config({"run": {"max_steps": 2000}, "trainer": {"lr_schedule": "cosine"}}, tmp_path)
    assert longer.training_changes(orjson.loads(orjson.dumps(after.training_settings()))) == {
        "trainer.loss.clip_high": (0.28, 0.2), "run.max_steps": (300, 2000),
        "async_rl.drop_zero_variance_groups": (True, False)}
    # Not fingerprinted: a restore under them is never refused, however --allow-config-change is set.
    assert after.fingerprint() == before.fingerprint() and after.fingerprint_changes(before.fingerprint_fields()) == {}
    # The whole loss table, a key added to it later included.
    loss_keys = {f"trainer.loss.{key}" for key in Config().trainer.loss.__struct_fields__}
    assert loss_keys <= set(Config().training_settings())


def inspected(bundle: Path) -> dict[str, Any]:
    done = subprocess.run([*SCD, "checkpoint", "inspect", "--json", str(bundle)], cwd=REPO, capture_output=True,
                          timeout=120, check=True)
    summary: dict[str, Any] = orjson.loads(done.stdout)
    return summary


def without_training_settings(bundle: Path) -> None:
    """The bundle as one written before its training settings were recorded (its commit marker made again)."""
    info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
    del info["training_settings"]
    (bundle / layout.TRAINING_INFO_FILE).write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
    (bundle / layout.COMMIT_MARKER).write_text(layout.sha256_file(bundle / layout.TRAINING_INFO_FILE))


def test_a_changed_loss_and_lr_schedule_are_applied_across_a_restore_and_reported_old_to_new(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    """From a bundle of the format before training settings were recorded: it restores with the defaults, which
    the restore event then reports as the old values."""
    config = write_config(tmp_path, ray_address=session_ray)
    first = ScdProcess(config, "--max-steps", "2")
    scd_processes.append(first)
    assert first.wait(timeout=300) == 0, first.output()[-3000:]
    [bundle] = layout.finalized_bundles(tmp_path / "out" / "checkpoints")
    assert inspected(bundle)["training_settings"] == Config().training_settings()
    without_training_settings(bundle)
    assert inspected(bundle)["training_settings"] == Config().training_settings()

    second = ScdProcess(config, "--max-steps", "4", "--set", "trainer.loss.clip_high=0.28",
                        "--set", "trainer.lr_schedule=linear")
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    events = events_in(tmp_path)
    [restore] = [e for e in events if e["event"] == "restore"]
    assert restore["training_changes"] == {"trainer.loss.clip_high": [0.2, 0.28],
                                           "trainer.lr_schedule": ["constant", "linear"],
                                           "run.max_steps": [NOT_SET, 20]}
    assert restore["optimizer_changes"] == {} and restore["reward_changes"] == {}
    said = second.output()
    assert said.count("restore: trainer.loss.clip_high is 0.28 in the config, 0.2 in") == 1, said[-3000:]
    assert said.count("restore: trainer.lr_schedule is linear in the config, constant in") == 1
    # Steps 3 and 4 train at the linear schedule's rate where the bundle left it (2 steps taken of run.max_steps).
    lrs = {e["step"]: e["lr"] for e in events if e["event"] == "train_step"}
    assert lrs[1] == lrs[2] == 1e-3
    assert lrs[3] == pytest.approx(1e-3 * lr_factor(2, total_steps=20, schedule="linear"))
    assert lrs[4] == pytest.approx(1e-3 * lr_factor(3, total_steps=20, schedule="linear"))
    assert lrs[3] < 1e-3
    # The bundles written since record the new settings: restoring one reports no change.
    settings = inspected(layout.finalized_bundles(tmp_path / "out" / "checkpoints")[-1])["training_settings"]
    assert settings == {**Config().training_settings(), "trainer.loss.clip_high": 0.28,
                        "trainer.lr_schedule": "linear", "run.max_steps": 20}


def test_a_changed_config_is_refused_before_ray_starts_naming_every_changed_key(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    config = write_config(tmp_path, ray_address=session_ray)
    first = ScdProcess(config, "--max-steps", "2")
    scd_processes.append(first)
    assert first.wait(timeout=300) == 0, first.output()[-3000:]
    [bundle] = layout.finalized_bundles(tmp_path / "out" / "checkpoints")
    started = sum(e["event"] == "start" for e in events_in(tmp_path))

    # A private Ray, as a user's run has: were the refusal late, this run would start Ray, TQ and the trainer.
    config.write_text(config.read_text().replace(f'address = "{session_ray}"', "num_cpus = 3"))
    second = ScdProcess(config, "--set", "task.seed=1", "--set", "generation.temperature=0.7")
    scd_processes.append(second)
    assert second.wait(timeout=300) == 3, second.output()[-3000:]
    said = second.output()
    assert f"scd: error: checkpoint {bundle}: was written under settings" in said, said[-3000:]
    assert "changes 2 of them" in said
    assert "task.seed: 0 -> 1" in said and "generation.temperature: 1.0 -> 0.7" in said
    assert "--allow-config-change" in said
    # Nothing expensive started: no TQ was attached to, and the controller never announced its start.
    assert "TransferQueue: controller on" not in said
    assert sum(e["event"] == "start" for e in events_in(tmp_path)) == started


# task.reward_start_timeout_s of the HTTP reward test: the outage at the restore outlasts it several times.
START_TIMEOUT_S = 1

# Two rewards a test can tell apart in every number a train step reports.
CONSTANT_REWARDS = """
def a(prompt, completion, answer, row):
    return 0.25


def b(prompt, completion, answer, row):
    return 0.75
"""


def test_a_changed_reward_set_is_applied_across_a_restore_and_no_score_of_the_old_one_is_trained(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    """Beside the changed reward, an HTTP one the restore keeps (weight 0: the numbers below are the constant
    reward's alone) whose service is down when the second run scores the restored groups again: it answered in
    the first run, so the rescore waits for it past task.reward_start_timeout_s instead of ending the run with
    exit 2."""
    (tmp_path / "consts.py").write_text(CONSTANT_REWARDS)
    service = RewardService(free_port(), tmp_path / "served.jsonl")
    rewards = ('\n[[task.rewards]]\nfunction = "consts:{}"\nname = "const"\n'
               '\n[[task.rewards]]\nfunction = "http"\nname = "remote"\nweight = 0.0\n'
               'args = {{ url = "{}", retries = 0, timeout_s = 5.0 }}\n')
    config = write_config(tmp_path, ray_address=session_ray, extra=rewards.format("a", service.url))
    config.write_text(config.read_text().replace("[task]\n", f"[task]\nreward_start_timeout_s = {START_TIMEOUT_S}\n"))
    try:
        service.start()
        first = ScdProcess(config, "--max-steps", "2")
        scd_processes.append(first)
        assert first.wait(timeout=300) == 0, first.output()[-3000:]
        [bundle] = layout.finalized_bundles(tmp_path / "out" / "checkpoints")
        held = decode(bundle / layout.SIDECAR_FILE, Sidecar)
        assert held.groups and {r for g in held.groups for r in g.rewards} == {0.25}, "no ready group to score again"
        service.stop()

        config.write_text(config.read_text().replace('"consts:a"', '"consts:b"'))
        second = ScdProcess(config, "--max-steps", "4")
        scd_processes.append(second)
        second.wait_for_line("reward 'remote' is unavailable", timeout=300)
        time.sleep(START_TIMEOUT_S + 5)
        assert second.proc.poll() is None, second.output()[-3000:]
        service.start()
        assert second.wait(timeout=300) == 0, second.output()[-3000:]
    finally:
        service.stop()
    assert "restore: rewards ['remote'] answered before this process" in second.output()

    events = events_in(tmp_path)
    restore = [e for e in events if e["event"] == "restore"][-1]
    assert restore["reward_changes"] == {"task.rewards[0].function": ["consts:a", "consts:b"]}
    assert restore["groups_rescored"] == restore["groups_restored"] > 0
    assert restore["scores_reused"] == 0  # a staged sibling's score under "a" is owed again
    assert "task.rewards[0].function is consts:b in the config, consts:a in" in second.output()
    trained = [e for e in events if e["event"] == "train_step" and e["step"] > 2]
    assert [e["step"] for e in trained] == [3, 4]
    # Every group trained after the restore, restored or generated since, carries b's score alone.
    assert all(e["reward_mean"] == 0.75 for e in trained), [e["reward_mean"] for e in trained]
    final = decode(layout.finalized_bundles(tmp_path / "out" / "checkpoints")[-1] / layout.SIDECAR_FILE, Sidecar)
    assert {r for g in final.groups for r in g.rewards} <= {0.75}
    assert {s.total for s in final.sibling_scores} <= {0.75}
