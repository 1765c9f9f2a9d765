"""Telemetry of a real running `scd`: every family after a checkpoint, a failure and a restore."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import anyio
import orjson
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from scd.checkpoint import layout
from scd.daemon import Controller
from scd.schema import RestorePhase
from scd.triggers import Triggers
from tests.conftest import REPO, SCD, ScdProcess, free_port, tiny_config, write_config
from tests.test_process import scrape

TELEMETRY = """
[checkpointing]
enabled = true
interval_s = 1
keep_last = 2
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def test_families_after_checkpoint_failure_and_restore(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    port = free_port()
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, port=port, extra=TELEMETRY)
    config.write_text(config.read_text().replace("[telemetry]\n", "[telemetry]\ntelemetry_interval_s = 0.5\n"))
    first = ScdProcess(config, env={"SCD_FAULT": "mid_sidecar_write:1=enospc"})
    scd_processes.append(first)
    first.wait_for_line("failed (disk_full")
    first.wait_for_line("checkpoint step_")
    first.wait_for_line("step 1 version")  # a loaded box's first bundle can come before any group completes
    text = scrape(port)
    now = time.time()
    assert value(text, "scd_checkpoint_attempts_total", outcome="failed", reason="disk_full") == 1
    assert value(text, "scd_checkpoint_attempts_total", outcome="completed", reason="interval") >= 1
    for outcome, reason in (("skipped", "no_progress"), ("skipped", "already_running"), ("failed", "timeout"),
                            ("failed", "invariant_violation"), ("completed", "signal")):
        assert (("scd_checkpoint_attempts_total", (("outcome", outcome), ("reason", reason)))) in samples(text)
    for phase in ("total", "tq_save", "barrier_wait", "exclusive_hold", "sidecar_write", "commit"):
        assert value(text, "scd_checkpoint_phase_seconds_count", phase=phase) >= 1
        assert value(text, "scd_checkpoint_phase_seconds_sum", phase=phase) >= 0
    assert value(text, "scd_checkpoint_phase_seconds_sum", phase="total") < 30
    assert now - 60 < value(text, "scd_last_checkpoint_timestamp_seconds") <= now
    assert value(text, "scd_checkpoint_sidecar_bytes") > 100
    assert value(text, "scd_checkpoint_data_plane_bytes") > 100
    assert value(text, "scd_checkpoint_interval_seconds") == 1
    assert value(text, "scd_checkpoint_blocked_mutations_total", kind="commit") >= 0
    assert ("scd_checkpoint_mutation_wait_seconds_count", ()) in samples(text)
    assert value(text, "scd_replay_rows") == 8 * value(text, "scd_replay_groups")
    assert value(text, "scd_staged_siblings") >= 0  # published with the other gauges (0: torch finishes groups whole)
    assert value(text, "scd_group_completion_latency_seconds_count") > 0
    assert value(text, "scd_group_admission_latency_seconds_count") > 0
    assert value(text, "scd_restore_phase_seconds_count", phase="total") == 0
    for name in ("scd_recovery_siblings_reused_total", "scd_recovery_siblings_rerun_total"):
        assert value(text, name) == 0
    first.kill_group()

    k = layout.step_of(layout.finalized_bundles(tmp_path / "out" / "checkpoints")[-1])
    assert k is not None
    second = ScdProcess(config, "--max-steps", str(k + 30))
    scd_processes.append(second)
    second.wait_for_line("restored ")
    second.wait_for_line(f"step {k + 2} ")
    text = scrape(port)
    assert value(text, "scd_restore_phase_seconds_count", phase="total") == 1
    for phase in RestorePhase:
        assert value(text, "scd_restore_phase_seconds_count", phase=phase.value) == 1
    assert value(text, "scd_restore_phase_seconds_sum", phase="total") < 30
    restored = value(text, "scd_recovery_groups_restored")
    evicted = value(text, "scd_recovery_groups_evicted_stale")
    assert restored >= 0 and evicted >= 0
    # Published (value() fails on a missing sample); 0 when every prompt in flight at the cut was complete
    # there, its siblings awaiting only their scores and commit (the torch backend finishes groups whole).
    assert value(text, "scd_recovery_prompts_redispatched") >= 0
    assert value(text, "scd_trainer_step") >= k + 2
    assert second.wait(timeout=300) == 0, second.output()[-3000:]

    events_path = tmp_path / "out" / "events.jsonl"
    events = [orjson.loads(line) for line in events_path.read_text().splitlines()]
    times = [e["time"] for e in events]
    assert times == sorted(times), "event time went backwards across the restart"
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    assert len(starts) == 2
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["step"] == k and restore["groups_restored"] == restored
    # Every phase is timed, and they follow one another: together they are the whole restore.
    phases = restore["phases"]
    assert set(phases) == {p.value for p in RestorePhase}
    assert sum(v for p, v in phases.items() if p != "total") == pytest.approx(phases["total"], abs=1e-3)
    assert phases["first_weight_sync"] > 0 and phases["policy_load"] > 0
    assert events[starts[1]]["time"] > max(e["time"] for e in events[: starts[1]])
    assert any(e["event"] == "sample" for e in events)
    train = [e for e in events if e["event"] == "train_step"]
    assert all({"epoch", "reward_mean", "prompt_ids", "time", "step"} <= set(e) for e in train)
    failed = [e for e in events if e["event"] == "checkpoint" and e["outcome"] == "failed"]
    assert [e["reason"] for e in failed] == ["disk_full"]
    # Every attempt records the time since the last success; after the restart, that is the bundle's time.
    attempts = [e for e in events if e["event"] == "checkpoint"]
    assert all("since_last_success_s" in e for e in attempts)
    after_restart = [e for e in attempts if e["time"] > events[starts[1]]["time"]]
    assert after_restart and all(e["since_last_success_s"] >= 0 for e in after_restart)

    report = subprocess.run([*SCD, "report", str(events_path), "-o", str(tmp_path / "report")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for name in ("reward.png", "throughput.png", "checkpoint_phases.png", "restore_times.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "restores" in report.stdout.lower()


async def test_generated_tokens_move_while_a_checkpoint_holds_the_barrier(tmp_path: Path, partition: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(tmp_path, partition, checkpointing={"enabled": True, "interval_s": 3600})
    seen: dict[str, float] = {}
    triggers = Triggers()
    async with Controller.open(config) as controller:
        real_save = controller.dataplane.save_snapshot

        async def slow_save(directory: Path) -> None:
            # TQ made slow, not faked: the real save runs after a second, outside the exclusive hold.
            # Only the requested checkpoint is watched, not the last one at shutdown.
            if "after" in seen:
                return await real_save(directory)
            seen["before"] = REGISTRY.get_sample_value("scd_generation_tokens_total") or 0.0
            await anyio.sleep(1.0)
            seen["after"] = REGISTRY.get_sample_value("scd_generation_tokens_total") or 0.0
            await real_save(directory)

        monkeypatch.setattr(controller.dataplane, "save_snapshot", slow_save)

        async def operator() -> None:
            while controller.state.trainer_step < 2:
                await anyio.sleep(0.01)
            triggers.request_checkpoint()
            while "after" not in seen:
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            await controller.run(triggers, max_steps=10_000)
        await controller.dataplane.clear_all()
    # Batches admitted before the cut kept generating, and the counter said so while the hold lasted.
    assert seen["after"] > seen["before"]


@pytest.mark.slow  # a subprocess
def test_every_known_label_has_a_sample_before_anything_happens() -> None:
    """a healthy run's ledger and waste panels showed "no data" until a first observation."""
    import sys

    from scd.ledger import PromptState
    from scd.records import WasteReason
    from tests.conftest import REPO

    scraped = subprocess.run([sys.executable, "-c", "import scd.telemetry.metrics\nfrom prometheus_client import "
                              "REGISTRY, generate_latest\nprint(generate_latest(REGISTRY).decode())"],
                             cwd=REPO, capture_output=True, text=True, check=True, timeout=120).stdout
    for state in PromptState:
        assert f'scd_ledger_prompts{{state="{state}"}} 0.0' in scraped
    for reason in WasteReason:
        assert f'scd_generation_wasted_tokens_total{{reason="{reason}"}} 0.0' in scraped
