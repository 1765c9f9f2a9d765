"""The checkpoint barrier: one cut, cancel safety, no writer starvation, re-entrant shared side."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scd.barrier import CheckpointBarrier, MutationKind
from scd.config import parse_config
from scd.errors import InvariantViolation
from scd.replay import GroupMeta, ReplayIndex
from scd.samplers import build_sampler
from scd.state import ControllerState, Restored


async def test_unknown_kind_fails() -> None:
    barrier = CheckpointBarrier()
    with pytest.raises(TypeError):
        async with barrier.mutation("commit"):  # type: ignore[arg-type]
            pass


async def test_checkpoint_waits_for_active_mutations_and_blocks_new_ones() -> None:
    barrier = CheckpointBarrier()
    log: list[str] = []
    release = anyio.Event()

    async def long_mutation() -> None:
        async with barrier.mutation(MutationKind.COMMIT):
            log.append("commit-start")
            await release.wait()
            log.append("commit-end")

    async def checkpoint() -> None:
        async with barrier.exclusive():
            log.append("cut")
            await anyio.sleep(0.01)
            log.append("cut-end")

    async def late_mutation() -> None:
        async with barrier.mutation(MutationKind.CONSUME):
            log.append("consume")

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_mutation)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(checkpoint)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(late_mutation)
        await anyio.wait_all_tasks_blocked()
        assert barrier.statistics().exclusive_waiting == 1
        release.set()
    assert log == ["commit-start", "commit-end", "cut", "cut-end", "consume"]
    stats = barrier.statistics()
    assert stats.blocked == {"consume": 1}
    assert stats.mutations == {"commit": 1, "consume": 1}


async def test_nested_mutation_does_not_deadlock_behind_a_queued_checkpoint() -> None:
    barrier = CheckpointBarrier()
    inside = anyio.Event()
    proceed = anyio.Event()
    order: list[str] = []

    async def commit_with_nested_evict() -> None:
        async with barrier.mutation(MutationKind.COMMIT):
            inside.set()
            await proceed.wait()
            async with barrier.mutation(MutationKind.EVICT):
                order.append("nested-evict")

    async def checkpoint() -> None:
        async with barrier.exclusive():
            order.append("cut")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(commit_with_nested_evict)
            await inside.wait()
            tg.start_soon(checkpoint)
            await anyio.wait_all_tasks_blocked()
            proceed.set()
    assert order == ["nested-evict", "cut"]


async def test_cancelled_waiters_leave_the_barrier_consistent() -> None:
    barrier = CheckpointBarrier()
    hold = anyio.Event()

    async def holder() -> None:
        async with barrier.mutation(MutationKind.COMMIT):
            await hold.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0.05):
            async with barrier.exclusive():
                pytest.fail("exclusive acquired while a mutation was active")
        # The cancelled checkpoint no longer blocks mutations.
        with anyio.fail_after(1):
            async with barrier.mutation(MutationKind.ADMIT):
                pass
        with anyio.move_on_after(0.05):
            async with barrier.exclusive():
                pytest.fail("exclusive acquired while a mutation was active")
        hold.set()
    stats = barrier.statistics()
    assert (stats.shared_active, stats.exclusive_active, stats.exclusive_waiting) == (0, False, 0)
    with anyio.fail_after(1):
        async with barrier.exclusive():
            pass


async def test_a_stream_of_mutations_does_not_starve_a_checkpoint() -> None:
    barrier = CheckpointBarrier()
    got_cut = anyio.Event()

    async def mutator() -> None:
        while not got_cut.is_set():
            async with barrier.mutation(MutationKind.COMMIT):
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(mutator)
        await anyio.sleep(0.01)
        with anyio.fail_after(1):
            async with barrier.exclusive():
                got_cut.set()


OPS = st.lists(st.tuples(st.sampled_from(["mutate", "nest", "checkpoint", "cancel"]),
                         st.integers(0, 3)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_interleavings_never_overlap_a_cut(ops: list[tuple[str, int]]) -> None:
    async def scenario() -> None:
        barrier = CheckpointBarrier()
        state = {"mutating": 0, "cuts": 0, "done": 0}

        async def mutate(delay: int, nested: bool) -> None:
            async with barrier.mutation(MutationKind.COMMIT):
                assert not barrier.statistics().exclusive_active
                state["mutating"] += 1
                await anyio.sleep(delay / 1000)
                if nested:
                    async with barrier.mutation(MutationKind.EVICT):
                        assert not barrier.statistics().exclusive_active
                state["mutating"] -= 1
            state["done"] += 1

        async def checkpoint(delay: int) -> None:
            async with barrier.exclusive():
                assert state["mutating"] == 0
                state["cuts"] += 1
                await anyio.sleep(delay / 1000)
                assert state["mutating"] == 0
            state["done"] += 1

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for op, delay in ops:
                    if op == "checkpoint":
                        tg.start_soon(checkpoint, delay)
                    elif op == "cancel":
                        scope = anyio.CancelScope()

                        async def cancellable(scope: anyio.CancelScope = scope, delay: int = delay) -> None:
                            with scope:
                                await checkpoint(delay + 1)

                        tg.start_soon(cancellable)
                        await anyio.sleep(0)
                        scope.cancel()
                    else:
                        tg.start_soon(mutate, delay, op == "nest")
                    await anyio.sleep(0)
        stats = barrier.statistics()
        assert (stats.shared_active, stats.exclusive_active, stats.exclusive_waiting) == (0, False, 0)

    anyio.run(scenario)


async def test_a_restores_rescore_replaces_ready_groups_as_a_mutation_under_the_barrier(tmp_path: Path) -> None:
    """The rescore of a restore under a changed reward set changes the controller state like any mutation: it
    waits out a checkpoint's exclusive hold (whose cut sees the groups as they were), is counted as a
    ``rescore``, and refuses, changing nothing, a group the replay index does not hold."""
    state = ControllerState(4, 0, build_sampler(parse_config({}, tmp_path)), None,  # type: ignore[arg-type]
                            CheckpointBarrier())
    held = GroupMeta(group_id="e0-p0", epoch=0, prompt_id=0, sample_ids=("e0-p0/0", "e0-p0/1"),
                     start_weight_version=0, end_weight_version=0, prompt_len=3, seq_lens=(5, 6), rewards=(0.0, 1.0),
                     weight_versions=(0, 0), reward_components={"old": 0.5})
    index = ReplayIndex()
    index.add(held)
    state.install(Restored(step=0, weight_version=0, dataloader=state.order.state, index=index, ledger=state.ledger,
                           sampler_state=state.sampler.state(), shadow=False, fates=state.fates.counts(), run=None))
    rescored = msgspec.structs.replace(held, rewards=(1.0, 1.0), reward_components={"new": 1.0})
    async with anyio.create_task_group() as tg:
        async with state.barrier.exclusive():
            tg.start_soon(state.replace_ready_groups, [rescored])
            await anyio.wait_all_tasks_blocked()
            assert state.replay.groups() == [held]
    assert state.replay.groups() == [rescored]
    stats = state.barrier.statistics()
    assert stats.mutations == {"rescore": 1} and stats.blocked == {"rescore": 1}

    unknown = msgspec.structs.replace(held, group_id="e0-p1")
    with pytest.raises(InvariantViolation, match="e0-p1"):
        await state.replace_ready_groups([rescored, unknown])
    assert state.replay.groups() == [rescored]
