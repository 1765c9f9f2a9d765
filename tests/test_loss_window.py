"""The loss window, live: the checkpoint interval set from what checkpoints cost (Young/Daly), and
the work a crash now would lose, on a real daemon (synthetic engine, the session's TQ)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import anyio
import msgspec
import orjson
import pytest
from prometheus_client import REGISTRY

from scd import faults
from scd.checkpoint.interval import CheckpointInterval, young_daly
from scd.checkpoint.restore import after_a_crash
from scd.config import CheckpointingConfig, parse_config
from scd.daemon import Controller
from scd.schema import RunIdentity, TrainingInfo
from scd.triggers import Triggers
from tests.conftest import tiny_config

MTBF_S, MIN_S, MAX_S = 20.0, 0.2, 2.5


def gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def completed_checkpoints(events: Path) -> list[dict]:
    return [e for e in map(orjson.loads, events.read_bytes().splitlines())
            if e["event"] == "checkpoint" and e["outcome"] == "completed"]


async def run_until(controller: Controller, done: int) -> None:
    """Train until ``done`` checkpoints have completed in all, then drain."""
    triggers = Triggers()
    assert controller.checkpointer is not None
    checkpointer = controller.checkpointer

    async def watch() -> None:
        while checkpointer.statistics().completed < done:
            await anyio.sleep(0.05)
        triggers.shutdown.set()

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await controller.run(triggers, max_steps=100_000)


async def test_the_auto_interval_follows_a_slower_save_within_its_clamps_and_the_risk_is_live(
        tmp_path: Path, partition: str) -> None:
    config = tiny_config(
        tmp_path, partition,
        checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": "auto",
                       "mtbf_s": MTBF_S, "min_interval_s": MIN_S, "max_interval_s": MAX_S},
        generation={"backend": "synthetic", "max_inflight_prompts": 16, "max_new_tokens": 12,
                    "synthetic": {"tokens_per_s": 20_000.0, "min_completion_tokens": 4, "max_completion_tokens": 12,
                                  "batch_groups": 4, "max_concurrent_batches": 4}})
    events = Path(config.telemetry.events_path)
    async with Controller.open(config) as controller:
        assert gauge("scd_checkpoint_interval_seconds") == MIN_S  # nothing measured yet: measure early
        await run_until(controller, 5)
        fast = completed_checkpoints(events)
        cost = statistics.median(e["cost_s"] for e in fast[-5:])
        assert fast[-1]["interval_s"] == min(max(young_daly(cost, MTBF_S), MIN_S), MAX_S)
        # Milliseconds of cost (tens on a loaded box): below the clamp a slow save's cost reaches.
        assert fast[-1]["interval_s"] < MAX_S, fast[-1]

        # Every cut from now on holds the barrier SLOW_S longer: the median cost follows after three.
        # (A drain's own checkpoint completed after the first five.)
        slow = ",".join(f"in_exclusive_hold:{n}=slow" for n in range(1, 20))
        with faults.armed(slow):
            await run_until(controller, len(fast) + 5)
        later = completed_checkpoints(events)[len(fast):]
        assert all(e["cost_s"] >= faults.SLOW_S for e in later)
        assert young_daly(statistics.median(e["cost_s"] for e in later), MTBF_S) > MAX_S
        assert later[-1]["interval_s"] == MAX_S == gauge("scd_checkpoint_interval_seconds")

        # The loss window: the newest bundle's cut is seconds old at most, and generation since
        # then is at risk until the next one.
        risk = controller.goodput.risk
        assert 0 <= risk.seconds() < MAX_S + 30
        assert risk.tokens() >= 0
        before = risk.tokens()
        with anyio.fail_after(30):
            while risk.tokens() <= before:
                await controller.run(max_steps=controller.state.trainer_step + 1)
        controller.goodput.risk.publish()
        assert gauge("scd_work_at_risk_tokens") == risk.tokens() > before
        assert math.isfinite(gauge("scd_work_at_risk_seconds"))
        await controller.dataplane.clear_all()


def test_mtbf_is_the_run_s_age_over_its_crash_restarts_and_a_clean_exit_is_no_crash() -> None:
    run = RunIdentity(run_id="r", started_at=time.time() - 1000.0)
    info = msgspec.structs.replace(decode_info_template(), run=run)
    crashed = after_a_crash(msgspec.structs.replace(info, trigger="interval"))
    assert crashed.crash_restores == 1
    assert after_a_crash(msgspec.structs.replace(info, trigger="final")).crash_restores == 0
    assert after_a_crash(msgspec.structs.replace(info, trigger="shutdown")).crash_restores == 0
    twice = after_a_crash(msgspec.structs.replace(info, run=crashed, trigger="signal"))
    # The run's seconds, as ControllerState.run_seconds counts them (never from wall clocks).
    estimated = CheckpointInterval(CheckpointingConfig(interval_s="auto"), lambda: twice, lambda: 1000.0)
    assert estimated.mtbf_s() == pytest.approx(500.0)
    assert CheckpointInterval(CheckpointingConfig(interval_s="auto"), lambda: run, lambda: 1000.0).mtbf_s() == math.inf
    assert CheckpointInterval(CheckpointingConfig(interval_s="auto", mtbf_s=7.0), lambda: twice,
                              lambda: 1000.0).mtbf_s() == 7.0
    # No crash yet: the longest interval; the first measurement comes at the shortest.
    no_crash = CheckpointInterval(CheckpointingConfig(interval_s="auto", min_interval_s=5, max_interval_s=600),
                                  lambda: run, lambda: 1000.0)
    assert no_crash.seconds() == 5
    no_crash.observe({"train_pump_blocked": 0.01, "state_copy": 0.02, "mutations_blocked": 0.0, "tq_save": 9.0})
    assert no_crash.cost_s() == pytest.approx(0.03) and no_crash.seconds() == 600


def test_a_run_restarted_on_a_clock_behind_its_start_still_gets_an_interval() -> None:
    """after a crash restart on a host whose clock reads earlier than the run's start, the first
    measured checkpoint took the square root of a negative age (ValueError) and the run exited 1."""
    from scd.telemetry import metrics

    behind = RunIdentity(run_id="r", started_at=time.time() + 3600.0, crash_restores=1)
    config = CheckpointingConfig(interval_s="auto", min_interval_s=5, max_interval_s=600)
    measured = CheckpointInterval(config, lambda: behind, lambda: 120.0)
    measured.observe({"train_pump_blocked": 0.5, "state_copy": 0.5})
    assert measured.seconds() == pytest.approx((2 * 1.0 * 120.0) ** 0.5)  # the run's own seconds, not the clock
    fallbacks = metrics.checkpoint_interval_fallbacks._value.get()
    just_restored = CheckpointInterval(config, lambda: behind, lambda: 0.0)  # a bundle from before run_s
    just_restored.observe({"train_pump_blocked": 0.5})
    assert just_restored.seconds() == 5
    assert metrics.checkpoint_interval_fallbacks._value.get() == fallbacks + 1


def test_the_runs_seconds_go_on_across_a_restore_by_monotonic_clocks() -> None:
    from scd.barrier import CheckpointBarrier
    from scd.samplers import build_sampler
    from scd.state import ControllerState, Restored

    config = parse_config({}, Path("/tmp"))
    state = ControllerState(4, 0, build_sampler(config), None, CheckpointBarrier())  # type: ignore[arg-type]
    restored = msgspec.structs.replace(state.run, run_s=100.0, started_at=time.time() + 3600.0)
    state.install(Restored(step=0, weight_version=0, dataloader=state.order.state, index=state.replay,
                           ledger=state.ledger, sampler_state=state.sampler.state(), shadow=False,
                           fates=state.fates.counts(), run=restored))
    assert 100.0 <= state.run_seconds() < 101.0


def decode_info_template() -> TrainingInfo:
    return TrainingInfo(step=1, weight_version=1, epoch=0, group_size=2, sampler="windowed",
                        supports_replay_checkpoint=True, partition="p", replay_digest="", groups=0, samples=0,
                        capacity=1, time=0.0, config_fingerprint="", config_fingerprint_fields={}, files={},
                        sidecar_bytes=0, data_plane_bytes=0)


async def test_a_drained_runs_in_flight_prompts_are_redispatched_not_lost_to_a_crash(
        tmp_path: Path, partition: str) -> None:
    """after SIGTERM's drain the restart counted the drained in-flight prompts lost_to_crash."""
    from scd.checkpoint import layout
    from scd.schema import Sidecar, decode

    # Slow generation: the drain's cut holds prompts in flight.
    config = tiny_config(tmp_path, partition, checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"),
                                                             "interval_s": 3600},
                         generation={"backend": "synthetic", "max_new_tokens": 40,
                                     "synthetic": {"tokens_per_s": 2_000.0, "min_completion_tokens": 20,
                                                   "max_completion_tokens": 40}})
    triggers = Triggers()
    async with Controller.open(config) as controller:

        async def drain_after_two_steps() -> None:
            while controller.state.trainer_step < 2:
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_after_two_steps)
            await controller.run(triggers=triggers, max_steps=1000)
        await controller.dataplane.clear_all()  # as the process's own TQ would go with it
    (bundle,) = layout.finalized_bundles(tmp_path / "checkpoints")
    assert decode(bundle / layout.TRAINING_INFO_FILE, TrainingInfo).trigger == "shutdown"
    sidecar = decode(bundle / layout.SIDECAR_FILE, Sidecar)
    in_flight = sum(entry.state == "in_flight" for entry in sidecar.ledger.entries)
    assert in_flight > 0
    async with Controller.open(config) as controller:
        report = await controller.restore()
        assert report is not None
        after = controller.state.fates.counts()
        run = controller.state.run
        await controller.dataplane.clear_all()
    assert sum(c["lost_to_crash"] for c in after.values()) == 0
    # Those with siblings to generate; one whose siblings the drain's bundle kept whole only awaits its commit.
    assert 0 < report.prompts_redispatched <= in_flight
    assert sum(c["redispatched"] for c in after.values()) == \
        sum(c["redispatched"] for c in sidecar.prompt_fates.values()) + report.prompts_redispatched
    assert run.crash_restores == 0
