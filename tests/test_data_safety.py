"""Data safety on the session's real TQ: cuts, commits, checkpoint failures, restores, retention, weights.

One real controller run per module (``golden``) makes the bundles that the restore,
retention and weight tests read; every other test opens its own controller on a
fresh partition.  TQ is never faked: a DataPlane method (or TQ's own function) is
replaced only to make TQ fail, hang or be slow.
"""

from __future__ import annotations

import math
import shutil
import threading
import traceback
import uuid
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.errors import ConfigError, DataPlaneError, InvariantViolation
from scd.generation.base import GroupRequest, GroupResult
from scd.ledger import PromptState
from scd.records import Completion, FinishReason, Rollout
from scd.schema import Outcome, Trigger
from scd.telemetry.events import Event, TrainStep
from scd.triggers import Triggers
from tests.conftest import tree_digest
from tests.support.bundles import copy_bundles, reseal
from tests.support.configs import CHECKPOINTING, config_for
from tests.support.scores import ZERO_SCORES
from tests.support.tq import clear_partition, dataplane_for

GOLDEN = "safety-golden"
WAIT_S = 30  # bound on anything a test waits for; a hang fails the test instead of the session


def a_rollout(i: int = 0) -> Rollout:
    return Rollout(torch.arange(6, dtype=torch.int64) + i, torch.linspace(-1, 0, 2), 4, reward=0.0,
                   weight_version=0)


async def put_sentinel() -> DataPlane:
    """A row in a partition of its own: a TQ load (which replaces all TQ state) would remove it."""
    dp = dataplane_for(f"sentinel-{uuid.uuid4().hex[:8]}")
    await dp.put_group("sentinel", [a_rollout()])
    assert await dp.list_keys() == {"sentinel"}
    return dp


async def checkpoint_now(controller: Controller) -> Outcome:
    """One checkpoint at the current step, written before this returns (as bench/run.py does)."""
    assert controller.checkpointer is not None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(controller.checkpointer.run_writer)
            outcome = await controller.checkpointer.attempt(Trigger.SIGNAL, wait=True)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0]  # noqa: B904 - the one real error, its own cause kept
        raise
    return outcome


async def generated(controller: Controller, n: int) -> list[GroupResult]:
    """Admit ``n`` prompts and have the real backend generate their groups (complete, not yet committed)."""
    requests: list[GroupRequest] = [await controller.rollouts.admit() for _ in range(n)]
    results = await controller.backend.generate(requests, lambda *reported: None)
    assert all(not r.incomplete_reason() for r in results)
    return results


def keys_of(result: GroupResult) -> set[str]:
    """TQ's keys for a group: one, its group id."""
    return {result.request.group_id}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def model_weights(controller: Controller) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in controller.trainer.model.state_dict().items()}


# ---- the module's one real run ---------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def golden(tq_session: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two runs of one controller, each: a signal checkpoint two steps in, a shutdown checkpoint two steps
    after it.  Four bundles are completed; ``keep_last = 2`` keeps the last two.  The trainer's weights
    are copied at every checkpoint's step boundary, independently of the checkpointer's own copy.

    The operator is driven from the controller's own hooks (train_step events, checkpoint attempts), so no
    task group is opened here.
    """
    root = tmp_path_factory.mktemp("safety-golden") / "checkpoints"
    await clear_partition(GOLDEN)
    config = config_for(root, GOLDEN)
    attempts: list[tuple[Trigger, int, Outcome]] = []
    weights_at: dict[int, dict[str, torch.Tensor]] = {}
    async with Controller.open(config) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        real_attempt, real_emit = checkpointer.attempt, controller.events.emit
        plan: dict[str, Any] = {}

        async def attempt(trigger: Trigger, *, wait: bool = False) -> Outcome:
            # The train pump is at its step boundary here: these are the weights of the cut's step.
            step = controller.state.trainer_step
            weights_at[step] = model_weights(controller)
            outcome = await real_attempt(trigger, wait=wait)
            attempts.append((trigger, step, outcome))
            if trigger is Trigger.SIGNAL and outcome is Outcome.SCHEDULED:
                plan["signal_step"] = step
            return outcome

        async def emit(event: Event) -> None:
            await real_emit(event)
            if not isinstance(event, TrainStep):
                return
            step = event.step
            triggers = plan["triggers"]
            if step >= plan["start"] + 2 and not plan["requested"]:
                plan["requested"] = True
                triggers.request_checkpoint()
            if "signal_step" in plan and step >= plan["signal_step"] + 2:
                triggers.shutdown.set()

        checkpointer.attempt = attempt
        controller.events.emit = emit
        for _ in range(2):
            plan.clear()
            plan.update(triggers=Triggers(), start=controller.state.trainer_step, requested=False)
            with anyio.fail_after(240):
                await controller.run(plan["triggers"], max_steps=10_000)
        final_step = controller.state.trainer_step
    await clear_partition(GOLDEN)
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_text().splitlines()]
    completed = [(e["reason"], e["step"]) for e in events if e["event"] == "checkpoint" and e["outcome"] == "completed"]
    return {"root": root, "attempts": attempts, "weights_at": weights_at, "completed": completed,
            "final_step": final_step}


# ---- 1. inventory disagreement on save ---------------------------------------------------------------------


async def test_save_with_tq_and_index_disagreeing_finalizes_nothing_and_is_an_invariant_violation(
    tmp_path: Path, partition: str
) -> None:
    root = tmp_path / "checkpoints"
    labels = {"outcome": "failed", "reason": "invariant_violation"}
    async with Controller.open(config_for(root, partition)) as controller:
        results = await generated(controller, 2)
        for result in results:
            await controller.rollouts.commit(result, ZERO_SCORES)
        dp = controller.dataplane
        assert await dp.list_keys() == keys_of(results[0]) | keys_of(results[1])
        victim = results[0].request.group_id

        # A row the index names is missing from TQ.
        await dp.clear([victim])
        before = metric("scd_checkpoint_attempts_total", **labels)
        with pytest.raises(InvariantViolation, match=r"1 groups of the cut missing from TQ") as missing:
            await checkpoint_now(controller)
        assert missing.value.exit_code == 3
        assert victim in str(missing.value)
        assert not layout.finalized_bundles(root) and not layout.leftover_tmp_dirs(root)
        assert not layout.step_dir(root, 0).exists() and not layout.tmp_dir(root, 0).exists()
        assert metric("scd_checkpoint_attempts_total", **labels) == before + 1
        assert not controller.state.barrier.statistics().exclusive_active

        # The row is back, and an extra row TQ should not have is there.
        await dp.put_group(victim, [a_rollout()])
        await dp.put_group("stray-group", [a_rollout(1)])
        with pytest.raises(InvariantViolation, match=r"1 groups in TQ that are neither in the cut nor put after it") \
                as extra:
            await checkpoint_now(controller)
        assert extra.value.exit_code == 3
        assert "stray-group" in str(extra.value)
        assert not layout.finalized_bundles(root) and not layout.leftover_tmp_dirs(root)
        assert metric("scd_checkpoint_attempts_total", **labels) == before + 2

        # Control: with TQ and the index agreeing again, the same checkpoint is finalized.
        await dp.clear(["stray-group"])
        assert await checkpoint_now(controller) is Outcome.COMPLETED
        assert [b.name for b in layout.finalized_bundles(root)] == ["step_00000000"]
        assert verify_bundle(layout.step_dir(root, 0)).info.groups == 2


# ---- 2, 3. a failing put during commit ------------------------------------------------------------------------


async def test_failed_put_during_commit_clears_its_rows_keeps_the_prompt_in_flight_and_propagates(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Controller.open(config_for(tmp_path / "checkpoints", partition)) as controller:
        dp, state = controller.dataplane, controller.state
        (result,) = await generated(controller, 1)
        gid = result.request.group_id
        real_put = dp.put_group
        injected = DataPlaneError("injected: TQ put failed after writing part of the group")
        written_before_failure: set[str] = set()

        async def put_part_then_fail(key: str, rows: Any) -> None:
            await real_put(key, list(rows)[:3])  # TQ wrote the key with part of the group, then failed
            written_before_failure.update(await dp.list_keys())
            raise injected

        monkeypatch.setattr(dp, "put_group", put_part_then_fail)
        in_flight, committed = state.in_flight, state.committed_groups
        with pytest.raises(DataPlaneError) as info:
            await controller.rollouts.commit(result, ZERO_SCORES)
        assert info.value is injected
        assert written_before_failure & keys_of(result)  # the cleanup had a key to clear
        assert not (await dp.list_keys()) & keys_of(result)
        assert state.ledger.state_of(gid) is PromptState.IN_FLIGHT
        assert gid not in state.replay and not state.replay.keys() & keys_of(result)
        assert (state.in_flight, state.committed_groups) == (in_flight, committed)
        assert state.barrier.statistics().shared_active == 0

        # The prompt is still in flight, so the same group can be committed once TQ works again.
        monkeypatch.undo()
        await controller.rollouts.commit(result, ZERO_SCORES)
        assert await dp.list_keys() == keys_of(result)
        assert state.ledger.state_of(gid) is PromptState.READY


async def test_failed_put_whose_cleanup_clear_fails_too_raises_the_put_error_with_the_clear_error_attached(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#33: the original put error propagates; the clear failure is visible on it, not instead of it."""
    async with Controller.open(config_for(tmp_path / "checkpoints", partition)) as controller:
        dp, state = controller.dataplane, controller.state
        (result,) = await generated(controller, 1)
        real_put = dp.put_group
        put_error = DataPlaneError("injected put failure (the original error)")
        clear_error = DataPlaneError("injected clear failure (during cleanup)")

        async def put_part_then_fail(key: str, rows: Any) -> None:
            await real_put(key, list(rows)[:2])
            raise put_error

        async def clear_fails(key: str) -> None:
            raise clear_error

        monkeypatch.setattr(dp, "put_group", put_part_then_fail)
        monkeypatch.setattr(dp, "discard_failed_put", clear_fails)
        with pytest.raises(DataPlaneError) as info:
            await controller.rollouts.commit(result, ZERO_SCORES)
        raised = info.value
        assert raised is put_error, f"the clear error replaced the put error: {raised!r}"
        notes = getattr(raised, "__notes__", [])
        assert raised.__cause__ is clear_error or any(str(clear_error) in note for note in notes)
        rendered = "".join(traceback.format_exception(raised))
        assert str(put_error) in rendered and str(clear_error) in rendered
        assert state.ledger.state_of(result.request.group_id) is PromptState.IN_FLIGHT
        assert result.request.group_id not in state.replay
        assert state.barrier.statistics().shared_active == 0
        monkeypatch.undo()
        await dp.clear_all()


# ---- 4. a TQ save that fails or hangs mid-checkpoint ----------------------------------------------------------


@pytest.mark.parametrize("failure", ["raises", "hangs"])
async def test_tq_save_failing_or_timing_out_releases_the_barrier_removes_tmp_and_is_retried(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    import transfer_queue as tq

    root = tmp_path / "checkpoints"
    timeout_s = 5.0
    config = config_for(root, partition, data_plane={"call_timeout_s": timeout_s},
                        checkpointing={"keep_last": 3})
    labels = {"outcome": "failed", "reason": "timeout"}
    unblock = threading.Event()
    async with Controller.open(config) as controller:
        state, checkpointer = controller.state, controller.checkpointer
        assert checkpointer is not None
        results = await generated(controller, 2)
        for result in results:
            await controller.rollouts.commit(result, ZERO_SCORES)
        assert await checkpoint_now(controller) is Outcome.COMPLETED  # the older bundle, step 0
        older = tree_digest(root)
        # One real step boundary further (a group consumed), so the next checkpoint is due at step 1.
        await state.finish_step([state.replay.groups()[0]])
        assert state.trainer_step == 1

        if failure == "raises":
            async def save_fails(directory: Path) -> None:
                raise DataPlaneError("injected: TQ save_checkpoint failed")

            monkeypatch.setattr(controller.dataplane, "save_snapshot", save_fails)
        else:
            def save_hangs(directory: Any) -> None:  # TQ's own save, stuck (a hung storage actor)
                unblock.wait(120)

            monkeypatch.setattr(tq, "save_checkpoint", save_hangs)
        before = metric("scd_checkpoint_attempts_total", **labels)
        try:
            started = anyio.current_time()
            with anyio.fail_after(WAIT_S):
                assert await checkpoint_now(controller) is Outcome.FAILED
            elapsed = anyio.current_time() - started
        finally:
            unblock.set()
        if failure == "hangs":
            assert timeout_s <= elapsed < timeout_s + 20
        assert metric("scd_checkpoint_attempts_total", **labels) == before + 1
        assert checkpointer.statistics().consecutive_failures == 1
        assert not layout.tmp_dir(root, 1).exists() and not layout.leftover_tmp_dirs(root)
        assert not layout.step_dir(root, 1).exists()
        assert tree_digest(root) == older
        barrier = state.barrier.statistics()
        assert not barrier.exclusive_active and barrier.exclusive_waiting == 0
        with anyio.fail_after(5):
            gid = await state.admit()  # a mutation goes through right away: the barrier was released
        assert state.ledger.state_of(gid) is PromptState.IN_FLIGHT

        # TQ works again: the next attempt succeeds and the older bundle is still there, unchanged.
        monkeypatch.undo()
        assert await checkpoint_now(controller) is Outcome.COMPLETED
        assert [b.name for b in layout.finalized_bundles(root)] == ["step_00000000", "step_00000001"]
        assert checkpointer.statistics().consecutive_failures == 0
        verify_bundle(layout.step_dir(root, 1))
        verify_bundle(layout.step_dir(root, 0))


# ---- 5, 13. the barrier between mutations and cuts ----------------------------------------------------------


async def test_mutations_wait_for_a_live_cut_and_a_cut_waits_for_an_in_flight_put(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Controller.open(config_for(tmp_path / "checkpoints", partition)) as controller:
        state, dp = controller.state, controller.dataplane
        first, second = await generated(controller, 2)

        # (a) A live cut: an admission and a commit both wait for it.
        holding, release = anyio.Event(), anyio.Event()
        admitted: list[str] = []
        committed = anyio.Event()

        async def hold_cut() -> None:
            async with state.barrier.exclusive():
                holding.set()
                await release.wait()

        async def admit() -> None:
            admitted.append(await state.admit())

        async def commit() -> None:
            await controller.rollouts.commit(first, ZERO_SCORES)
            committed.set()

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold_cut)
                await holding.wait()
                cursor, ledger_size = state.order.state.cursor, len(state.ledger)
                tg.start_soon(admit)
                tg.start_soon(commit)
                await anyio.sleep(0.5)
                assert not admitted and not committed.is_set()
                assert (state.order.state.cursor, len(state.ledger)) == (cursor, ledger_size)
                assert not (await dp.list_keys()) & keys_of(first)  # the commit's put has not happened
                assert state.barrier.statistics().exclusive_active
                release.set()
                await committed.wait()
        assert len(admitted) == 1 and state.order.state.cursor == cursor + 1
        assert state.ledger.state_of(first.request.group_id) is PromptState.READY

        # (b) A put in flight: the cut is not taken until the put has returned and the commit is whole.
        real_put = dp.put_group
        put_entered, let_put_go = anyio.Event(), anyio.Event()
        order: list[str] = []

        async def slow_put(key: str, rows: Any) -> None:
            put_entered.set()
            await let_put_go.wait()  # TQ is slow, then does the real put
            await real_put(key, rows)
            order.append("put returned")

        monkeypatch.setattr(dp, "put_group", slow_put)
        seen_in_cut: dict[str, Any] = {}

        async def take_cut() -> None:
            async with state.barrier.exclusive():
                order.append("exclusive acquired")
                seen_in_cut["cut"] = state.snapshot()
                seen_in_cut["tq"] = await dp.list_keys()

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(controller.rollouts.commit, second, ZERO_SCORES)
                await put_entered.wait()
                tg.start_soon(take_cut)
                await anyio.sleep(0.5)
                assert order == []
                stats = state.barrier.statistics()
                assert stats.exclusive_waiting == 1 and not stats.exclusive_active and stats.shared_active == 1
                let_put_go.set()
        assert order == ["put returned", "exclusive acquired"]
        cut = seen_in_cut["cut"]
        assert second.request.group_id in {g.group_id for g in cut.groups}
        assert seen_in_cut["tq"] == keys_of(first) | keys_of(second) == state.replay.keys()


async def test_two_mutations_run_concurrently_outside_a_cut(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Controller.open(config_for(tmp_path / "checkpoints", partition)) as controller:
        state, dp = controller.state, controller.dataplane
        results = await generated(controller, 2)
        real_put = dp.put_group
        entered: list[str] = []
        both_inside, let_go = anyio.Event(), anyio.Event()
        shared_seen: list[int] = []

        async def slow_put(key: str, rows: Any) -> None:
            entered.append(key)
            if len(entered) == 2:
                both_inside.set()
            await let_go.wait()
            await real_put(key, rows)

        monkeypatch.setattr(dp, "put_group", slow_put)
        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                for result in results:
                    tg.start_soon(controller.rollouts.commit, result, ZERO_SCORES)
                await both_inside.wait()
                shared_seen.append(state.barrier.statistics().shared_active)
                let_go.set()
        assert shared_seen == [2]
        assert state.barrier.statistics().shared_active == 0
        assert {r.request.group_id for r in results} <= {g.group_id for g in state.replay.groups()}
        assert await dp.list_keys() == keys_of(results[0]) | keys_of(results[1])


# ---- 6. atomic admission ------------------------------------------------------------------------------------


async def test_admission_is_atomic_no_cut_shows_a_cursor_without_its_ledger_entry(
    tmp_path: Path, partition: str
) -> None:
    async with Controller.open(config_for(tmp_path / "checkpoints", partition)) as controller:
        state = controller.state
        n = state.order.num_prompts
        admitters, per_admitter = 8, 20  # 160 admissions: two epoch rollovers of 64 prompts
        cuts: list[Any] = []
        admissions_done = anyio.Event()

        async def admit_some() -> None:
            for _ in range(per_admitter):
                await state.admit()
                await anyio.sleep(0)

        async def cut_repeatedly() -> None:
            while not admissions_done.is_set():
                async with state.barrier.exclusive():
                    cuts.append(state.snapshot())
                await anyio.sleep(0)

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cut_repeatedly)
                async with anyio.create_task_group() as admitting:
                    for _ in range(admitters):
                        admitting.start_soon(admit_some)
                admissions_done.set()
        async with state.barrier.exclusive():
            cuts.append(state.snapshot())

        assert len(cuts) >= 20
        assert len({(c.dataloader.epoch, c.dataloader.cursor) for c in cuts}) >= 5  # cuts interleaved admits
        for cut in cuts:
            epoch, cursor = cut.dataloader.epoch, cut.dataloader.cursor
            per_epoch: dict[int, set[int]] = {}
            for entry in cut.ledger.entries().values():
                per_epoch.setdefault(entry.epoch, set()).add(entry.prompt_id)
            ranks = state.order.ranks(epoch)
            expected = {pid for pid, rank in ranks.items() if rank < cursor}
            assert per_epoch.get(epoch, set()) == expected, (epoch, cursor)
            assert all(per_epoch.get(e) == set(range(n)) for e in range(epoch)), (epoch, cursor)
            assert max(per_epoch, default=0) <= epoch
            assert len(cut.ledger) == epoch * n + cursor
        last = cuts[-1].dataloader
        assert last.epoch * n + last.cursor == admitters * per_admitter
        assert state.in_flight == admitters * per_admitter


# ---- 7, 8. restore refuses an unclean data plane or an incomplete bundle --------------------------------------


async def test_restore_refuses_a_data_plane_that_served_operations_or_holds_rows(
    golden: dict[str, Any], tmp_path: Path
) -> None:
    root = copy_bundles(golden, tmp_path)
    config = config_for(root, GOLDEN)
    await clear_partition(GOLDEN)
    sentinel = await put_sentinel()

    async with Controller.open(config) as controller:
        assert await controller.dataplane.list_keys() == set()  # an ordinary data op before the restore
        with pytest.raises(InvariantViolation, match="already served 1 operations"):
            await controller.restore()
        assert controller.state.trainer_step == 0 and len(controller.state.replay) == 0
        assert await controller.dataplane.list_keys() == set()
    assert await sentinel.list_keys() == {"sentinel"}  # TQ was not loaded

    stray = dataplane_for(GOLDEN)
    await stray.put_group("stray", [a_rollout()])
    async with Controller.open(config) as controller:
        assert controller.dataplane.data_ops == 0
        with pytest.raises(InvariantViolation, match="already holds 1 groups"):
            await controller.restore()
        assert controller.state.trainer_step == 0 and len(controller.state.replay) == 0
    assert await stray.list_keys() == {"stray"}
    assert await sentinel.list_keys() == {"sentinel"}
    await clear_partition(GOLDEN)


async def raw_values(partition: str, keys: list[str]) -> list[bytes]:
    """The stored bytes of ``keys``, exactly as TQ holds them."""
    import transfer_queue as tq

    return (await tq.async_kv_batch_get(keys=keys, partition_id=partition)).get("group").tolist()


async def test_restore_refuses_while_another_partition_holds_rows_and_leaves_them_bit_for_bit(
    golden: dict[str, Any], tmp_path: Path
) -> None:
    """TQ's load replaces all of TQ's state: rows of a partition scd does not own are never wiped."""
    root = copy_bundles(golden, tmp_path)
    bundle = layout.finalized_bundles(root)[-1]
    await clear_partition(GOLDEN)
    other = dataplane_for(f"other-run-{uuid.uuid4().hex[:8]}")
    await other.put_group("g0", [a_rollout(0), a_rollout(1)])
    await other.put_group("g1", [a_rollout(2)])
    await other.put_siblings(["g2/0/v0"], [Completion([1, 2], [-0.5, -0.25], FinishReason.STOP, 0)])
    stored = await raw_values(other.partition, ["g0", "g1"]), await raw_values(other.staging, ["g2/0/v0"])
    # A window wide enough that no restored group is evicted as stale (an eviction clears its rows).
    config = config_for(root, GOLDEN, async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 100}})
    async with Controller.open(config) as controller:
        with pytest.raises(ConfigError) as info:
            await controller.restore(allow_config_change=True)
        assert info.value.exit_code == 2
        message = str(info.value)
        assert f"{other.partition!r} (2 keys)" in message and f"{other.staging!r} (1 keys)" in message, message
        assert "data_plane.ray.address" in message
        assert controller.state.trainer_step == 0 and len(controller.state.replay) == 0
        assert await controller.dataplane.list_keys() == set()  # the snapshot was not loaded
    assert (await raw_values(other.partition, ["g0", "g1"]), await raw_values(other.staging, ["g2/0/v0"])) == stored
    assert await other.list_keys() == {"g0", "g1", "g2/0/v0"}

    # Control: with the other run's rows gone, the same restore loads the bundle.
    await other.clear_all()
    async with Controller.open(config) as controller:
        await controller.restore(allow_config_change=True)
        assert controller.state.trainer_step == layout.step_of(bundle)
        assert await controller.dataplane.list_keys() == {g.group_id for g in verify_bundle(bundle).sidecar.groups}
    await clear_partition(GOLDEN)


def _without_data_plane(bundle: Path) -> None:
    shutil.rmtree(bundle / layout.DATA_PLANE_DIR)
    reseal(bundle)


def _without_dataloader(bundle: Path) -> None:
    (bundle / layout.DATALOADER_FILE).unlink()
    reseal(bundle)


@pytest.mark.parametrize(("breaker", "message"), [
    (_without_data_plane, "data_plane/"),
    (_without_dataloader, "train_dataloader.json is not part of the bundle"),
], ids=["no data_plane", "no dataloader file"])
async def test_incomplete_bundle_is_refused_before_tq_or_the_trainer_is_loaded(
    golden: dict[str, Any], tmp_path: Path, breaker: Any, message: str
) -> None:
    root = copy_bundles(golden, tmp_path)
    bundle = layout.finalized_bundles(root)[-1]
    breaker(bundle)
    before = tree_digest(root)
    await clear_partition(GOLDEN)
    sentinel = await put_sentinel()
    async with Controller.open(config_for(root, GOLDEN)) as controller:
        initial = model_weights(controller)
        with pytest.raises(InvariantViolation) as info:
            await controller.restore(restore_from=bundle)
        assert message in str(info.value) and str(bundle) in str(info.value)
        assert controller.dataplane.data_ops == 0
        assert controller.state.trainer_step == 0 and len(controller.state.ledger) == 0
        assert all(torch.equal(initial[k], v) for k, v in model_weights(controller).items())
        assert await controller.dataplane.list_keys() == set()
    assert await sentinel.list_keys() == {"sentinel"}  # a TQ load would have replaced it
    assert tree_digest(root) == before


# ---- 9. restored groups count against capacity ------------------------------------------------------------------


async def test_restored_groups_count_against_buffer_capacity(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    # The kept bundle with the most ready groups (a newer one is moved aside): on a loaded box generation can
    # fall behind training, and a checkpoint then finds the buffer empty.
    bundle = max(layout.finalized_bundles(root), key=lambda b: verify_bundle(b).info.groups)
    verified = verify_bundle(bundle)
    ready = verified.info.groups
    in_flight = len(verified.ledger.in_state(PromptState.IN_FLIGHT))
    assert ready > 0
    headroom = 3
    capacity = ready + in_flight + headroom
    config = config_for(root, GOLDEN, generation={"max_inflight_prompts": 64},
                        async_rl={"buffer_capacity_groups": max(capacity, 4),
                                  "sampler": {"name": "windowed", "max_staleness_versions": 100}})
    capacity = config.async_rl.buffer_capacity_groups
    await clear_partition(GOLDEN)
    async with Controller.open(config) as controller:
        await controller.restore(bundle, allow_config_change=True, discard_newer=True)
        state = controller.state
        assert len(state.replay) == ready
        restored_in_flight = set(state.ledger.in_state(PromptState.IN_FLIGHT))
        send, receive = anyio.create_memory_object_stream[GroupRequest](math.inf)
        requests: list[GroupRequest] = []
        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(controller.rollout_pump, send)
                while state.in_flight + len(state.replay) < capacity:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.5)  # room for any admission beyond capacity to show
                tg.cancel_scope.cancel()
        while True:
            try:
                requests.append(receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        new = [r for r in requests if r.group_id not in restored_in_flight]
        # A group the cut holds every sibling of (awaiting its scores or its commit) needs no generation.
        complete = {g for g in restored_in_flight
                    if len(controller.rollouts.finished_siblings(g)) == config.generation.group_size}
        assert {r.group_id for r in requests} - {r.group_id for r in new} == restored_in_flight - complete
        assert len(new) == capacity - ready - in_flight
        assert state.in_flight + len(state.replay) == capacity
        assert not controller.rollouts.has_capacity()
    await clear_partition(GOLDEN)


# ---- 10, 12. retention and weights, from the golden run ----------------------------------------------------------


async def test_retention_keeps_exactly_keep_last_finalized_bundles(golden: dict[str, Any]) -> None:
    root = golden["root"]
    completed = golden["completed"]
    assert [reason for reason, _ in completed] == ["signal", "shutdown", "signal", "shutdown"]
    steps = [step for _, step in completed]
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert [layout.step_of(b) for b in layout.finalized_bundles(root)] == steps[-CHECKPOINTING["keep_last"]:]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [f"step_{s:08d}" for s in steps[-2:]]
    assert not layout.leftover_tmp_dirs(root)
    assert (root / layout.LATEST).read_text() == f"step_{steps[-1]:08d}"
    for bundle in layout.finalized_bundles(root):
        verify_bundle(bundle)


async def test_bundle_weights_are_bit_equal_to_the_trainers_weights_at_the_cut_step(golden: dict[str, Any]) -> None:
    bundles = layout.finalized_bundles(golden["root"])
    signal_step = [step for reason, step in golden["completed"] if reason == "signal"][-1]
    assert layout.step_of(bundles[0]) == signal_step  # a mid-run cut: training went on while it was written
    assert golden["final_step"] >= signal_step + 2
    for bundle in bundles:
        step = layout.step_of(bundle)
        saved = torch.load(bundle / layout.MODEL_FILE, weights_only=True)
        at_cut = golden["weights_at"][step]
        assert saved.keys() == at_cut.keys()
        for name, tensor in at_cut.items():
            assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), (bundle, name)
        info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
        assert info["step"] == info["weight_version"] == step
    # The comparison can tell steps apart: the weights moved between the two bundles.
    first, last = (golden["weights_at"][layout.step_of(b)] for b in bundles)
    assert any(not torch.equal(first[k], last[k]) for k in first)


# ---- 11. an empty buffer's checkpoint ------------------------------------------------------------------------------


async def test_checkpoint_of_an_empty_buffer_at_immediate_shutdown_verifies_and_restores(
    tmp_path: Path, partition: str
) -> None:
    root = tmp_path / "checkpoints"
    config = config_for(root, partition)
    triggers = Triggers()
    triggers.shutdown.set()  # SIGTERM right after start
    async with Controller.open(config) as controller:
        with anyio.fail_after(WAIT_S * 2):
            await controller.run(triggers, max_steps=10_000)
        assert controller.state.trainer_step == 0
    bundles = layout.finalized_bundles(root)
    assert [b.name for b in bundles] == ["step_00000000"]
    verified = verify_bundle(bundles[0])
    assert verified.info.groups == 0 and verified.info.samples == 0 and not verified.sidecar.groups
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_text().splitlines()]
    assert [(e["outcome"], e["reason"]) for e in events if e["event"] == "checkpoint"][-1] == ("completed", "shutdown")

    await clear_partition(partition)
    async with Controller.open(config) as controller:
        await controller.restore()
        assert controller.state.trainer_step == 0 and len(controller.state.replay) == 0
        assert controller.checkpointer is not None and controller.checkpointer.last_completed_step == 0
        assert await controller.dataplane.list_keys() == set()
        with anyio.fail_after(WAIT_S * 2):
            await controller.run(max_steps=1)  # and it trains on from there
        assert controller.state.trainer_step == 1
    assert [b.name for b in layout.finalized_bundles(root)] == ["step_00000000", "step_00000001"]
    await clear_partition(partition)


# ---- 14. contention shows in the metrics ----------------------------------------------------------------------------


async def test_mutations_blocked_by_a_real_checkpoint_are_counted(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    async with Controller.open(config_for(root, partition)) as controller:
        state, dp = controller.state, controller.dataplane
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        first, second = await generated(controller, 2)
        real_put = dp.put_group
        put_entered, let_put_go = anyio.Event(), anyio.Event()

        async def first_put_slow(key: str, rows: Any) -> None:
            if key == first.request.group_id:
                put_entered.set()
                await let_put_go.wait()
            await real_put(key, rows)

        monkeypatch.setattr(dp, "put_group", first_put_slow)
        blocked_before = {kind: metric("scd_checkpoint_blocked_mutations_total", kind=kind)
                          for kind in ("commit", "admit")}
        waits_before = metric("scd_checkpoint_mutation_wait_seconds_count")
        outcome: list[Outcome] = []

        async def checkpoint() -> None:
            outcome.append(await checkpointer.attempt(Trigger.SIGNAL, wait=True))

        with anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                await tg.start(checkpointer.run_writer)
                tg.start_soon(controller.rollouts.commit, first, ZERO_SCORES)  # a real commit, its put in flight
                await put_entered.wait()
                tg.start_soon(checkpoint)  # a real checkpoint: it waits for that put
                while not state.barrier.statistics().exclusive_waiting:
                    await anyio.sleep(0.01)
                async with anyio.create_task_group() as behind:
                    behind.start_soon(controller.rollouts.commit, second, ZERO_SCORES)  # queued behind the checkpoint
                    behind.start_soon(state.admit)
                    await anyio.sleep(0.2)
                    let_put_go.set()
                while not outcome:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        assert outcome == [Outcome.COMPLETED]
        for kind in ("commit", "admit"):
            assert metric("scd_checkpoint_blocked_mutations_total", kind=kind) >= blocked_before[kind] + 1, kind
        assert metric("scd_checkpoint_mutation_wait_seconds_count") >= waits_before + 2
        # The cut holds the commit that was in flight, not the one that waited for it.
        groups = {g.group_id for g in verify_bundle(layout.step_dir(root, 0)).sidecar.groups}
        assert groups == {first.request.group_id}
        assert state.ledger.state_of(second.request.group_id) is PromptState.READY
    await clear_partition(partition)
