"""Guarded behaviours: each test here fails if the one behaviour it names is removed from scd.

Real parts only: the session's real TQ (a TQ function is wrapped only to record the calls scd makes),
real torch generation and training, real bundles on disk, and a real `scd` subprocess where the
behaviour is the process's (an exit code).  Fakes appear only in the unit tests of pure logic (the
replay index, the barrier, the weight_fifo sampler), and none of those fake a part of scd.
"""

from __future__ import annotations

import inspect
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import pytest_asyncio

from scd.barrier import CheckpointBarrier, MutationKind
from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from scd.config import load_config, parse_config
from scd.daemon import Controller
from scd.errors import ConfigError, InvariantViolation
from scd.ledger import PromptState
from scd.replay import GroupMeta, ReplayIndex, group_hash, require_exact_inventory
from scd.samplers import WeightFifoSampler, build_sampler
from scd.schema import Outcome, Trigger
from scd.telemetry.events import Event, Sample
from scd.triggers import Triggers
from tests.conftest import REPO, SCD, tiny_config
from tests.support.bundles import edit_json
from tests.support.configs import config_for
from tests.support.tq import clear_partition
from tests.test_behaviours import commit_all, events_of, train_one_step
from tests.test_data_safety import WAIT_S, checkpoint_now, generated, metric

PARTITION = "guarded-bundle"
# The module's bundle is made once: every test of the module runs on one xdist worker.


# ---- helpers -------------------------------------------------------------------------------------------------


class TQPuts:
    """Every call scd makes to any of TQ's put functions while ``recording``; the real functions run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import transfer_queue as tq

        self.calls: list[tuple[str, Any]] = []
        self.recording = False
        names = [name for name in dir(tq) if "put" in name.lower() and callable(getattr(tq, name))]
        assert "async_kv_batch_put" in names, names  # the one scd uses: a rename must not blind this test
        for name in names:
            real = getattr(tq, name)
            wrap = self._async if inspect.iscoroutinefunction(real) else self._sync
            monkeypatch.setattr(tq, name, wrap(name, real))

    def _note(self, name: str, kwargs: dict[str, Any], args: tuple[Any, ...]) -> None:
        if self.recording:
            self.calls.append((name, kwargs.get("keys", args[:1])))

    def _async(self, name: str, real: Any) -> Any:
        async def put(*args: Any, **kwargs: Any) -> Any:
            self._note(name, kwargs, args)
            return await real(*args, **kwargs)
        return put

    def _sync(self, name: str, real: Any) -> Any:
        def put(*args: Any, **kwargs: Any) -> Any:
            self._note(name, kwargs, args)
            return real(*args, **kwargs)
        return put


def record_events(monkeypatch: pytest.MonkeyPatch, controller: Controller, on_event: Callable[[Event], None]) -> None:
    """Call ``on_event(event)`` for every event the controller emits, before the real emit runs (which it does)."""
    real_emit = controller.events.emit

    async def emit(event: Event) -> None:
        on_event(event)
        await real_emit(event)

    monkeypatch.setattr(controller.events, "emit", emit)


def ledger_gauges() -> dict[str, float]:
    return {state.value: metric("scd_ledger_prompts", state=state.value) for state in PromptState}


def scd_verify(bundle: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCD, "checkpoint", "verify", str(bundle)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


# ---- the module's one real bundle ------------------------------------------------------------------------------


def bundle_config(root: Path) -> Any:
    return config_for(root, PARTITION)  # windowed, window 1, 4 groups a step


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bundle(tq_session: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real bundle at step 1: 2 ready groups (generated, scored and committed by the real backend, in the
    window), one group in flight with 2 siblings staged in TQ, a real trained step's trainer state."""
    root = tmp_path_factory.mktemp("guarded-bundle") / "checkpoints"
    await clear_partition(PARTITION)
    async with Controller.open(bundle_config(root)) as controller:
        await commit_all(controller, 6)
        await train_one_step(controller)
        (pending,) = await generated(controller, 1)  # generated, not committed: in flight
        group_id = pending.request.group_id
        await controller.state.stage_siblings([(group_id, i, pending.completions[i]) for i in (0, 1)])
        assert await checkpoint_now(controller) is Outcome.COMPLETED
        await controller.dataplane.clear_all()
    await clear_partition(PARTITION)
    path = layout.step_dir(root, 1)
    verified = verify_bundle(path)
    assert verified.info.groups == 2 and len(verified.ledger.staged_keys()) == 2
    return path


@pytest.fixture
def bundle_copy(bundle: Path, tmp_path: Path) -> Path:
    """A copy of the module's bundle in this test's own checkpoint directory, to edit."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    copy = root / bundle.name
    shutil.copytree(bundle, copy)
    return copy


# ---- 1. a restore puts no rollout tensor back into TQ -----------------------------------------------------------


async def test_a_restore_puts_no_rollout_tensor_into_tq(bundle_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows come back through TQ's own snapshot load: not one put, for the ready groups or the staged
    siblings, though both are back in TQ after it."""
    config = bundle_config(bundle_copy.parent)
    puts = TQPuts(monkeypatch)
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        puts.recording = True
        report = await controller.restore()
        puts.recording = False
        assert report is not None and report.bundle == bundle_copy
        assert report.groups_restored == 2 and report.siblings_reused == 2
        # Both kinds of row are in TQ, and none was put there.
        expected = controller.state.replay.keys() | controller.state.ledger.staged_keys()
        assert len(expected) == 4 and await controller.dataplane.list_keys() == expected
        assert puts.calls == []
        # Recording works: the first commit after the restore is a put.
        puts.recording = True
        await commit_all(controller, 1)
        assert [name for name, _ in puts.calls] == ["async_kv_batch_put"]
        await controller.dataplane.clear_all()
    await clear_partition(PARTITION)


# ---- 2. scd_ledger_prompts{state} and the sample event's ledger are the ledger's counts ------------------------


async def test_the_ledger_gauges_and_the_sample_events_ledger_equal_the_ledgers_counts(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config(tmp_path, partition, trainer={"groups_per_step": 4}, task={"size": 64},
                         telemetry={"telemetry_interval_s": 0.05})
    triggers = Triggers()
    seen: list[tuple[dict[str, int], dict[str, int], dict[str, float]]] = []
    async with Controller.open(config) as controller:
        state = controller.state

        def on_event(event: Event) -> None:
            if isinstance(event, Sample):
                # The sampler published the gauges and read the counts with no await since: all three agree now.
                seen.append((dict(event.ledger), state.ledger.counts(), ledger_gauges()))

        record_events(monkeypatch, controller, on_event)

        def interesting() -> list[dict[str, int]]:
            return [counts for _, counts, _ in seen if counts["consumed"] and counts["in_flight"]]

        async def operator() -> None:
            while len(interesting()) < 3 or state.trainer_step < 2:
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        with anyio.fail_after(WAIT_S * 2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(operator)
                await controller.run(triggers, max_steps=100_000)
        # After the run: the gauges the last step published are the ledger's counts too.
        controller.watch.publish_gauges()
        final = (state.ledger.counts(), ledger_gauges())
        logged = [e["ledger"] for e in events_of(controller) if e["event"] == "sample"]
        await controller.dataplane.clear_all()
    assert len(interesting()) >= 3
    assert len({tuple(sorted(counts.items())) for _, counts, _ in seen}) >= 2, "the counts never moved"
    for event_ledger, counts, gauges in seen:
        assert set(counts) == {s.value for s in PromptState}
        assert event_ledger == counts
        assert gauges == {state: float(n) for state, n in counts.items()}
    counts, gauges = final
    assert gauges == {s: float(n) for s, n in counts.items()}
    # The events in the log say the same as the ones recorded on their way there (the shutdown may have
    # cancelled the last one's write).
    assert len(logged) >= len(seen) - 1 and logged == [event_ledger for event_ledger, _, _ in seen][:len(logged)]
    await clear_partition(partition)


# ---- 3. scd_checkpoint_seconds_since_last_success grows, and resets at a success --------------------------------


async def test_seconds_since_the_last_checkpoint_success_grows_and_resets_at_a_success(
    tmp_path: Path, partition: str
) -> None:
    root = tmp_path / "checkpoints"
    name = "scd_checkpoint_seconds_since_last_success"
    async with Controller.open(config_for(root, partition)) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        await commit_all(controller, 4)
        assert await checkpoint_now(controller) is Outcome.COMPLETED  # A, at step 0
        growing = []
        for _ in range(3):  # attempts at the same step: skipped, each later than the last
            assert await checkpointer.attempt(Trigger.SIGNAL) is Outcome.SKIPPED
            growing.append(metric(name))
        assert 0 < growing[0] < growing[1] < growing[2], growing
        await train_one_step(controller)  # real training: time passes between the two successes
        before_b = time.time()
        assert await checkpoint_now(controller) is Outcome.COMPLETED  # B, at step 1
        at_b = metric(name)  # recorded at B: the time since A
        assert at_b > growing[2]
        assert await checkpointer.attempt(Trigger.SIGNAL) is Outcome.SKIPPED
        after_b = metric(name)
        elapsed_since_b_began = time.time() - before_b
        # Counted from B, not from A: within the time since B began (a train step and the skipped attempts
        # less than the time since A), and less than at B (one skipped attempt against a train step and a write).
        assert 0 < after_b <= elapsed_since_b_began, (after_b, elapsed_since_b_began, at_b)
        assert after_b < at_b
        events = [e for e in events_of(controller) if e["event"] == "checkpoint"]
        await controller.dataplane.clear_all()
    # Each attempt's event carries the value the gauge was set to.
    outcomes = [(e["outcome"], e["reason"]) for e in events]
    assert outcomes == [("scheduled", "signal"), ("completed", "signal"), *[("skipped", "no_progress")] * 3,
                        ("scheduled", "signal"), ("completed", "signal"), ("skipped", "no_progress")]
    assert events[0]["since_last_success_s"] is None  # nothing completed yet in this run
    assert [events[i]["since_last_success_s"] for i in (2, 3, 4, 6, 7)] == [*growing, at_b, after_b]
    await clear_partition(partition)


# ---- 4. sample events keep coming while a train step is held open ----------------------------------------------


async def test_sample_events_keep_coming_while_a_train_step_is_held_open(
    tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config(tmp_path, partition, trainer={"groups_per_step": 4}, task={"size": 64},
                         telemetry={"telemetry_interval_s": 0.05})
    triggers = Triggers()
    samples: list[tuple[float, int]] = []  # (monotonic time, trainer step) of each sample event
    held: dict[str, Any] = {}
    async with Controller.open(config) as controller:
        state, real_train_step = controller.state, controller.train_step
        in_step, release = anyio.Event(), anyio.Event()

        async def train_step(batch: list[GroupMeta], groups: Any) -> None:
            if state.trainer_step == 1 and not in_step.is_set():
                held["since"] = time.monotonic()
                in_step.set()
                await release.wait()
                held["until"] = time.monotonic()
            await real_train_step(batch, groups)

        monkeypatch.setattr(controller, "train_step", train_step)
        record_events(monkeypatch, controller,
                      lambda e: samples.append((time.monotonic(), e.step)) if isinstance(e, Sample) else None)

        async def operator() -> None:
            await in_step.wait()
            with anyio.move_on_after(WAIT_S):  # judged below, once the run is over
                while sum(1 for at, _ in samples if at > held["since"]) < 5:
                    await anyio.sleep(0.01)
            release.set()
            while state.trainer_step < 3:
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        with anyio.fail_after(WAIT_S * 2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(operator)
                await controller.run(triggers, max_steps=100_000)
        await controller.dataplane.clear_all()
    during = [step for at, step in samples if held["since"] < at < held["until"]]
    assert len(during) >= 5 and set(during) == {1}, samples
    await clear_partition(partition)


# ---- 5. the step of training_info.json, of the step_N directory and of the ledger agree -------------------------


def test_a_bundle_whose_step_disagrees_with_its_directory_is_refused_with_exit_3(bundle_copy: Path) -> None:
    """Two ways a bundle's step can disagree with the name it is found (and ordered, and retained) by: the
    directory renamed, and training_info re-sealed with another step (weight_version with it, as a real
    step would).  ``scd checkpoint verify`` must refuse each with exit 3, naming the step and the bundle."""
    assert verify_bundle(bundle_copy).info.step == layout.step_of(bundle_copy) == 1  # as written, it verifies

    renamed = bundle_copy.with_name(layout.step_dir(bundle_copy.parent, 2).name)
    shutil.copytree(bundle_copy, renamed)
    edit_json(bundle_copy, layout.TRAINING_INFO_FILE,
              lambda info: info.update(step=info["step"] + 1, weight_version=info["weight_version"] + 1))
    answers = {"directory renamed to step 2": (renamed, scd_verify(renamed)),
               "training_info re-sealed at step 2": (bundle_copy, scd_verify(bundle_copy))}
    accepted = {what: (proc.returncode, proc.stdout.strip(), proc.stderr.strip()[-500:])
                for what, (path, proc) in answers.items()
                if proc.returncode != 3 or str(path) not in proc.stderr or "step" not in proc.stderr}
    assert not accepted, f"not refused with exit 3 naming the bundle and its step: {accepted}"


# ---- 6. the replay index ------------------------------------------------------------------------------------------


def meta(i: int, *, components: dict[str, float] | None = None, target: int | None = None) -> GroupMeta:
    group_id = f"e0-p{i}"
    return GroupMeta(group_id=group_id, epoch=0, prompt_id=i, sample_ids=(f"{group_id}/0", f"{group_id}/1"),
                     start_weight_version=i, end_weight_version=i, prompt_len=3, seq_lens=(5, 6),
                     rewards=(0.0, 1.0), weight_versions=(i, i), target_step=target,
                     reward_components=components if components is not None else {"a": 0.5, "b": 0.25})


def test_the_replay_index_adds_evicts_digests_independently_of_order_and_keeps_its_inventory() -> None:
    groups = [meta(i) for i in range(4)]
    index = ReplayIndex()
    for g in groups:
        index.add(g)
    assert [g.group_id for g in index.groups()] == [g.group_id for g in groups]  # commit order: FIFO selection
    assert len(index) == 4 and index.rows == 8 and "e0-p2" in index
    assert index.keys() == {g.group_id for g in groups}
    assert index.sample_ids() == {s for g in groups for s in g.sample_ids}
    with pytest.raises(ValueError, match="e0-p1 is already in the replay index"):
        index.add(groups[1])
    assert len(index) == 4 and index.rows == 8  # a refused add changes nothing

    # The digest depends on the groups, not on the order they were added in ...
    reverse = ReplayIndex()
    for g in reversed(groups):
        reverse.add(g)
    assert reverse.digest() == index.digest()
    # ... nor on the order of the keys inside a group's metadata (a sidecar's JSON, read back).
    swapped = meta(0, components={"b": 0.25, "a": 0.5})
    assert list(swapped.reward_components) != list(groups[0].reward_components)
    assert group_hash(swapped) == group_hash(groups[0])
    round_trip = msgspec.json.decode(msgspec.json.encode(groups[0]), type=GroupMeta)
    assert group_hash(round_trip) == group_hash(groups[0])
    # Any change to a group's content changes it.
    other = ReplayIndex()
    for g in [msgspec.structs.replace(groups[0], rewards=(1.0, 1.0)), *groups[1:]]:
        other.add(g)
    assert other.digest() != index.digest()

    # Evicting a group takes it out of every view; the digest is that of an index that never had it.
    evicted = index.remove("e0-p2")
    assert evicted == groups[2]
    assert "e0-p2" not in index and len(index) == 3 and index.rows == 6
    assert index.keys() == {"e0-p0", "e0-p1", "e0-p3"}
    assert not index.sample_ids() & set(groups[2].sample_ids)
    never = ReplayIndex()
    for g in (groups[3], groups[0], groups[1]):
        never.add(g)
    assert never.digest() == index.digest() != reverse.digest()
    with pytest.raises(KeyError):
        index.remove("e0-p2")
    # Re-targeting is part of the content too.
    index.retarget("e0-p0", 7)
    assert index.digest() != never.digest()
    index.retarget("e0-p0", None)
    assert index.digest() == never.digest()

    # Exact inventory: TQ's keys equal the index's groups, no more, no fewer.
    require_exact_inventory(index.keys(), {"e0-p0", "e0-p1", "e0-p3"}, "here")
    with pytest.raises(InvariantViolation, match=r"1 groups missing from TQ \(first: \['e0-p3'\]\), 1 unexpected "
                                                 r"in TQ \(first: \['e0-p2'\]\)"):
        require_exact_inventory(index.keys(), {"e0-p0", "e0-p1", "e0-p2"}, "here")
    with pytest.raises(InvariantViolation, match=r"0 groups missing .* 1 unexpected"):
        require_exact_inventory(index.keys(), {*index.keys(), "e0-p9"}, "here")


# ---- 7. a second checkpoint request during a cut waits its turn ----------------------------------------------------


async def test_a_second_checkpoint_during_a_cut_waits_its_turn_in_order() -> None:
    """Checkpoints asked for while a cut holds the barrier get it one at a time, in the order they asked, and
    a mutation that asked between them waits for all of them (the barrier prefers checkpoints); nothing
    deadlocks."""
    barrier = CheckpointBarrier()
    log: list[str] = []
    holding = {"cuts": 0, "max": 0}
    release = {name: anyio.Event() for name in ("first", "second", "third")}
    inside = {name: anyio.Event() for name in release}

    async def checkpoint(name: str) -> None:
        log.append(f"{name} asks")
        async with barrier.exclusive():
            holding["cuts"] += 1
            holding["max"] = max(holding["max"], holding["cuts"])
            log.append(f"{name} cuts")
            inside[name].set()
            await release[name].wait()
            holding["cuts"] -= 1
        log.append(f"{name} done")

    async def mutation() -> None:
        log.append("commit asks")
        async with barrier.mutation(MutationKind.COMMIT):
            assert not barrier.statistics().exclusive_active
            log.append("commit runs")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(checkpoint, "first")
            await inside["first"].wait()
            tg.start_soon(checkpoint, "second")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(mutation)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(checkpoint, "third")
            await anyio.wait_all_tasks_blocked()
            # Both later checkpoints wait while the first cut holds the barrier.
            assert barrier.statistics().exclusive_waiting == 2
            assert "second cuts" not in log and "third cuts" not in log
            release["first"].set()
            await inside["second"].wait()
            await anyio.wait_all_tasks_blocked()
            assert "third cuts" not in log and "commit runs" not in log
            release["second"].set()
            await inside["third"].wait()
            release["third"].set()
    assert holding["max"] == 1
    assert log == ["first asks", "first cuts", "second asks", "commit asks", "third asks", "first done",
                   "second cuts", "second done", "third cuts", "third done", "commit runs"]
    stats = barrier.statistics()
    assert (stats.shared_active, stats.exclusive_active, stats.exclusive_waiting) == (0, False, 0)


# ---- 8. weight_fifo at window 0: one batch, then it blocks; no target step ------------------------------------------


def test_weight_fifo_at_window_0_dispatches_one_batch_then_blocks_and_stamps_no_target(tmp_path: Path) -> None:
    config = parse_config({"trainer": {"groups_per_step": 4},
                           "async_rl": {"sampler": {"name": "weight_fifo", "max_staleness_versions": 0}}}, tmp_path)
    sampler = build_sampler(config)
    assert isinstance(sampler, WeightFifoSampler)
    for step in range(3):
        targets = []
        for _ in range(100):
            if not sampler.may_dispatch(step):
                break
            targets.append(sampler.on_dispatch())
        # One step's batch, then it blocks (asked again, still blocked) until the trainer moves on.
        assert targets == [None] * 4, (step, targets)
        assert not sampler.may_dispatch(step) and not sampler.may_dispatch(step)
    assert sampler.state() == {"dispatched": 12, "groups_per_step": 4}
    # A group evicted stale frees its slot: one more dispatch, and no more.
    sampler.on_evicted(meta(0))
    assert sampler.may_dispatch(2) and sampler.on_dispatch() is None and not sampler.may_dispatch(2)


# ---- 9. a sidecar or group entry missing a required key is refused with exit 3 naming the key -----------------------


def _drop_sidecar_key(sidecar: dict[str, Any]) -> None:
    del sidecar["partition"]


def _drop_group_key(sidecar: dict[str, Any]) -> None:
    del sidecar["groups"][0]["seq_lens"]


@pytest.mark.parametrize(("drop", "key"), [(_drop_sidecar_key, "partition"), (_drop_group_key, "seq_lens")],
                         ids=["sidecar key", "group key"])
def test_a_sidecar_or_group_missing_a_required_key_is_refused_with_exit_3_naming_it(
    bundle_copy: Path, drop: Any, key: str
) -> None:
    edit_json(bundle_copy, layout.SIDECAR_FILE, drop)  # re-sealed: only the missing key is wrong
    refused = scd_verify(bundle_copy)
    assert refused.returncode == 3, (refused.returncode, refused.stdout, refused.stderr)
    assert f"missing required field `{key}`" in refused.stderr, refused.stderr
    assert layout.SIDECAR_FILE in refused.stderr and str(bundle_copy) in refused.stderr
    assert "Traceback" not in refused.stderr


# ---- 10. a removed data_plane.backend set to anything but its legal value exits 2 naming the key ------------------


@pytest.mark.slow  # an `scd` subprocess
def test_a_removed_data_plane_backend_other_than_simple_exits_2_naming_the_key(tmp_path: Path) -> None:
    # The one value that was ever legal still loads (and is dropped) ...
    legal = tmp_path / "legal.toml"
    legal.write_text('[data_plane]\nbackend = "simple"\n')
    assert load_config(legal).data_plane.partition
    # ... any other is refused, in-process and by the command, naming the key and why.
    bad = tmp_path / "bad.toml"
    bad.write_text('[data_plane]\nbackend = "rocksdb"\n')
    with pytest.raises(ConfigError, match=r"removed .*only 'simple' was ever legal") as refused:
        load_config(bad)
    assert refused.value.key == "data_plane.backend"
    proc = subprocess.run([*SCD, "run", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "'data_plane.backend'" in proc.stderr and "only 'simple' was ever legal" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

