"""Real TQ on a real local Ray: round trips, snapshot size, and memory freed by clears."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest
import torch

from scd.config import DataPlaneConfig
from scd.dataplane import DataPlane, call_within
from scd.errors import ConfigError, DataPlaneError
from scd.records import Rollout


def make_dataplane(partition: str) -> DataPlane:
    return DataPlane(DataPlaneConfig(partition=partition, call_timeout_s=30))


def rollout(i: int, completion: int, prompt: int = 4) -> Rollout:
    ids = torch.arange(prompt + completion, dtype=torch.int64) + i
    return Rollout(ids, torch.linspace(-1, 0, completion), prompt, reward=i / 10, weight_version=i % 3)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def storage_bytes_held() -> int:
    """Bytes of values the TQ storage actors keep referenced (each group is one ``bytes``)."""
    import ray
    from transfer_queue import interface

    def held(unit) -> int:
        values = [v for field in unit.storage_data.field_data.values() for v in field.values()]
        assert all(isinstance(v, bytes) for v in values), {type(v) for v in values}
        return sum(len(v) for v in values)

    handles = interface._TQ_STORAGE["SimpleStorage"].values()
    return sum(ray.get([h.__ray_call__.remote(held) for h in handles]))


async def test_variable_length_groups_round_trip(partition: str) -> None:
    dp = make_dataplane(partition)
    # Completion lengths 0..4 (an EOS-first completion is an empty logprob row) and two identical
    # siblings, in groups of different sizes.
    groups = {"g0": [rollout(i, completion=i) for i in range(5)] + [rollout(7, completion=3)] * 2,
              "g1": [rollout(9, completion=1)], "g2": [rollout(3, completion=2), rollout(4, completion=0)]}
    for key, rows in groups.items():
        await dp.put_group(key, rows)
    assert await dp.list_keys() == set(groups)
    order = ["g2", "g0", "g1"]
    for key, back in zip(order, await dp.get_groups(order), strict=True):
        assert len(back) == len(groups[key])
        for (ids_row, logprobs_row), want in zip(back, groups[key], strict=True):
            assert torch.equal(ids_row, want.input_ids)
            assert torch.equal(logprobs_row, want.logprobs)
    await dp.clear(["g0", "g1"])
    assert await dp.list_keys() == {"g2"}


async def test_missing_groups_are_an_error_not_a_short_read(partition: str) -> None:
    dp = make_dataplane(partition)
    await dp.put_group("g1", [rollout(0, 4)])
    with pytest.raises(DataPlaneError, match="1 of 2 groups"):
        await dp.get_groups(["g1", "g2"])


async def test_snapshot_is_about_payload_and_clears_free_memory(partition: str, tmp_path: Path) -> None:
    dp = make_dataplane(partition)
    await dp.clear_all()
    before = storage_bytes_held()
    groups, group_size, completion = 150, 8, 1024
    payload = 0
    for g in range(groups):
        rows = [rollout(g * group_size + s, completion) for s in range(group_size)]
        payload += sum(r.input_ids.nbytes + r.logprobs.nbytes for r in rows)
        await dp.put_group(f"g{g}", rows)

    held = storage_bytes_held() - before
    assert held < 1.1 * payload + 64 * 1024, (held, payload)

    await dp.save_snapshot(tmp_path / "snap")
    size = dir_bytes(tmp_path / "snap")
    assert size < 1.1 * payload + 256 * 1024, f"snapshot {size} bytes for {payload} bytes of rows"

    # Clear every other group: each value owns its memory, so half of it is freed.
    await dp.clear([f"g{g}" for g in range(0, groups, 2)])
    after_clear = storage_bytes_held() - before
    assert after_clear < 0.55 * held + 64 * 1024, (after_clear, held)
    await dp.clear_all()


async def test_attaching_to_a_tq_of_another_layout_names_the_key_and_placement_is_on_loopback(
    tq_session: None
) -> None:
    """TQ ignores the config of a process that attaches to it; scd does not."""
    async with DataPlane.open(DataPlaneConfig(partition="attach")) as dp:
        # The session's TQ: one storage unit, controller and unit on the embedded Ray's loopback node.
        assert dp.placement.controller.startswith("127.")
        assert len(dp.placement.storage_units) == 1 and dp.placement.storage_units[0].startswith("127.")
    with pytest.raises(ConfigError, match=r"'data_plane\.storage_units': the running TransferQueue has 1") as info:
        async with DataPlane.open(DataPlaneConfig(partition="attach", storage_units=2)):
            pass
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError, match=r"'data_plane\.required_node_resource'"):
        async with DataPlane.open(DataPlaneConfig(partition="attach", required_node_resource="tq_storage")):
            pass


async def fan_out_with_one_unit_hung() -> list[object]:
    """TQ's shape of a call: a gather over storage units, where the last unit answered and another hangs."""
    async def hung() -> None:
        await asyncio.Event().wait()

    async def answered() -> str:
        return "ok"

    return await asyncio.gather(asyncio.ensure_future(hung()), asyncio.ensure_future(answered()),
                                return_exceptions=True)


async def test_a_deadline_inside_a_gather_is_a_timeout_though_python_drops_anyio_s_cancel_message() -> None:
    # The trap: fail_after lets a bare CancelledError escape instead of raising TimeoutError.
    with pytest.raises(asyncio.CancelledError):
        with anyio.fail_after(0.1):
            await fan_out_with_one_unit_hung()
    with pytest.raises(TimeoutError):
        await call_within(0.1, fan_out_with_one_unit_hung)
    assert await call_within(5, lambda: asyncio.sleep(0, result="answer")) == "answer"


async def test_a_cancelled_caller_is_cancelled_not_timed_out() -> None:
    with anyio.CancelScope() as outer:
        outer.cancel()
        await call_within(5, fan_out_with_one_unit_hung)
    assert outer.cancelled_caught
