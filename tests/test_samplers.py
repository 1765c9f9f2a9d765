"""Samplers never hand the trainer a group outside the staleness window (property tests)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scd.config import parse_config
from scd.errors import ConfigError
from scd.replay import GroupMeta
from scd.samplers import BUILTIN_SAMPLERS, InOrderSampler, Sampler, WindowedSampler, build_sampler
from tests.conftest import REPO, SCD


def group(i: int, version: int, target: int | None = None) -> GroupMeta:
    return GroupMeta(group_id=f"g{i}", epoch=0, prompt_id=i, sample_ids=(f"g{i}/0", f"g{i}/1"),
                     start_weight_version=version, end_weight_version=version, prompt_len=2, seq_lens=(3, 3),
                     rewards=(0.0, 1.0), weight_versions=(version, version),
                     target_step=target)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(BUILTIN_SAMPLERS)),
    versions=st.lists(st.integers(0, 30), max_size=40),
    trainer_version=st.integers(0, 30),
    window=st.integers(0, 5),
    per_step=st.integers(1, 8),
)
def test_selection_is_always_inside_the_window(name, versions, trainer_version, window, per_step):
    sampler = BUILTIN_SAMPLERS[name](window, per_step)
    ready = [group(i, v, target=trainer_version if i % 2 else None) for i, v in enumerate(versions)]
    chosen = sampler.select(ready, trainer_version, trainer_version)
    assert len(chosen) in (0, per_step)
    for g in chosen:
        assert g.start_weight_version >= trainer_version - window
        assert g in ready
    assert len({g.group_id for g in chosen}) == len(chosen)


def test_windowed_takes_oldest_fresh_groups_first():
    sampler = WindowedSampler(max_staleness_versions=1, groups_per_step=2)
    ready = [group(0, 1), group(1, 5), group(2, 4), group(3, 5)]
    assert [g.group_id for g in sampler.select(ready, 5, 5)] == ["g1", "g2"]
    assert sampler.is_stale(ready[0], 5)


def test_in_order_trains_exactly_its_target_step():
    sampler = InOrderSampler(max_staleness_versions=0, groups_per_step=2)
    targets = [sampler.on_dispatch() for _ in range(4)]
    assert targets == [0, 0, 1, 1]
    assert not sampler.may_dispatch(trainer_step=1)
    ready = [group(i, 0, target=t) for i, t in enumerate(targets)]
    assert [g.group_id for g in sampler.select(ready, 0, 0)] == ["g0", "g1"]
    assert sampler.select(ready[1:], 0, 0) == []


class LeakyQuota(WindowedSampler):
    """Claims recovery (inherited flag) but gates on a quota that state() does not carry."""

    name = "leaky_quota"

    def __init__(self, max_staleness_versions: int, groups_per_step: int) -> None:
        super().__init__(max_staleness_versions, groups_per_step)
        self.quota = 3 * groups_per_step

    def may_dispatch(self, trainer_step: int) -> bool:
        return self.quota > 0

    def on_dispatch(self) -> int | None:
        self.quota -= 1
        return super().on_dispatch()


class ShadowInOrder(InOrderSampler):
    """A custom gated sampler that declares no replay support: it restores in shadow mode."""

    name = "shadow_in_order"
    supports_replay_checkpoint = False


class NotASampler:
    supports_replay_checkpoint = True

    def __init__(self, *args: object) -> None:
        pass


class CustomWindowed(WindowedSampler):
    name = "custom_windowed"


class WindowedThatGates(WindowedSampler):
    """Gates dispatch on the count the base state() carries: its behaviour shows it recoverable."""

    name = "windowed_that_gates"

    def may_dispatch(self, trainer_step: int) -> bool:
        return self.dispatched < 4 * (trainer_step + 1)


class NoCapability(Sampler):
    name = "no_capability"

    def select(self, ready, trainer_version, trainer_step):
        return []


NOT_CALLABLE = 42


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.test_samplers:LeakyQuota", r"gates dispatch \(it overrides \['may_dispatch', 'on_dispatch'\]\) with state"),
    ("tests.test_samplers:NotASampler", "not a subclass"),
    ("tests.test_samplers:NOT_CALLABLE", "not a subclass"),
    ("tests.test_samplers:NoCapability", "must declare supports_replay_checkpoint"),
    ("tests.test_samplers:Missing", "cannot load custom sampler"),
])
def test_custom_sampler_capability_is_checked_by_behaviour(tmp_path, spec, message):
    config = parse_config({"async_rl": {"sampler": {"name": spec}}}, tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        build_sampler(config)
    assert info.value.key == "async_rl.sampler.name"


@pytest.mark.parametrize("spec", ["tests.test_samplers:CustomWindowed", "tests.test_samplers:WindowedThatGates",
                                  "in_order", "weight_fifo"])
def test_a_sampler_whose_dispatch_state_round_trips_may_claim_recovery(tmp_path, spec):
    config = parse_config({"async_rl": {"sampler": {"name": spec}}}, tmp_path)
    sampler = build_sampler(config)
    assert sampler.supports_replay_checkpoint


@pytest.mark.parametrize("name", ["in_order", "weight_fifo"])
def test_a_gated_sampler_never_stalls_when_its_groups_go_stale(name):
    """Simulate dispatch, a backend whose stamps lag a version, eviction and selection: every step fills.

    The lag is what vLLM-style stamping does (a request queued before a weight sync finishes
    carries the old version); with staleness 1 in_order stalled at step 3 of 30 before the fix.
    """
    per_step, window = 4, 1
    sampler = BUILTIN_SAMPLERS[name](window, per_step)
    ready: list[GroupMeta] = []
    made = 0
    for step in range(30):
        for _ in range(200):
            while sampler.may_dispatch(step):
                target = sampler.on_dispatch()
                # Every other group was generated by the weights two versions back.
                lag = 2 if made % 2 else 0
                ready.append(group(made, max(step - lag, 0), target))
                made += 1
            for g in [g for g in ready if sampler.is_stale(g, step)]:
                ready.remove(g)
                sampler.on_evicted(g)
            chosen = sampler.select(ready, step, step)
            if chosen:
                break
        else:
            pytest.fail(f"{name} stalled at step {step}")
        for g in chosen:
            ready.remove(g)


@pytest.mark.slow  # an `scd` subprocess
def test_a_bad_custom_sampler_exits_2_before_ray_starts(tmp_path):
    config = tmp_path / "scd.toml"
    config.write_text('[async_rl.sampler]\nname = "tests.test_samplers:LeakyQuota"\n')
    started = time.monotonic()
    out = subprocess.run([*SCD, "run", str(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "config key 'async_rl.sampler.name'" in out.stderr and "gates dispatch" in out.stderr
    assert "Traceback" not in out.stderr
    # Ray never started: no Ray banner and it took far less than a Ray start-up.
    assert "ray" not in out.stderr.lower() and time.monotonic() - started < 30


@pytest.mark.slow  # an `scd` subprocess
@pytest.mark.parametrize(("source", "error"), [
    ("class Broken(:\n", "SyntaxError"),
    ("raise RuntimeError('needs a GPU at import')\n", "RuntimeError: needs a GPU at import"),
], ids=["syntax error", "error at import"])
def test_a_custom_sampler_module_that_fails_to_import_exits_2_before_ray_starts(tmp_path, source, error):
    (tmp_path / "broken_sampler.py").write_text(source)
    config = tmp_path / "scd.toml"
    config.write_text('[async_rl.sampler]\nname = "broken_sampler:Sampler"\n')
    started = time.monotonic()
    out = subprocess.run([*SCD, "run", str(config)], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 2, out.stderr
    assert "config key 'async_rl.sampler.name'" in out.stderr and "broken_sampler:Sampler" in out.stderr
    assert error in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "ray" not in out.stderr.lower() and time.monotonic() - started < 30
