"""Samplers never hand the trainer a group outside the staleness window (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scd.config import parse_config
from scd.errors import ConfigError
from scd.replay import GroupMeta
from scd.samplers import BUILTIN_SAMPLERS, InOrderSampler, WindowedSampler, build_sampler


def group(i: int, version: int, target: int | None = None) -> GroupMeta:
    return GroupMeta(group_id=f"g{i}", epoch=0, prompt_id=i, sample_ids=(f"g{i}/0", f"g{i}/1"),
                     start_weight_version=version, end_weight_version=version, prompt_len=2, seq_lens=(3, 3),
                     fields=("input_ids",), rewards=(0.0, 1.0), weight_versions=(version, version),
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


class GatedButClaimsRecovery(InOrderSampler):
    name = "custom"
    supports_replay_checkpoint = True


class NotASampler:
    supports_replay_checkpoint = True

    def __init__(self, *args: object) -> None:
        pass


class CustomWindowed(WindowedSampler):
    name = "custom_windowed"


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.test_samplers:GatedButClaimsRecovery", "gates dispatch"),
    ("tests.test_samplers:NotASampler", "not a subclass"),
    ("tests.test_samplers:Missing", "cannot load custom sampler"),
])
def test_custom_sampler_capability_is_checked_after_construction(tmp_path, spec, message):
    config = parse_config({"async_rl": {"sampler": {"name": spec}}}, tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        build_sampler(config)
    assert info.value.key == "async_rl.sampler.name"


def test_a_well_declared_custom_sampler_is_built(tmp_path):
    config = parse_config({"async_rl": {"sampler": {"name": "tests.test_samplers:CustomWindowed"}}}, tmp_path)
    sampler = build_sampler(config)
    assert isinstance(sampler, CustomWindowed) and sampler.supports_replay_checkpoint
