"""The checkpoint barrier: one cut, cancel safety, no writer starvation, re-entrant shared side."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scd.barrier import CheckpointBarrier, MutationKind


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
