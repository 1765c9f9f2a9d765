"""A real `scd run` subprocess: it reaches --max-steps, serves /metrics, and drains on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson

from scd.checkpoint import layout
from scd.checkpoint.verify import storage_units_of, verify_bundle
from tests.conftest import ScdProcess, free_port, tree_digest, write_config


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_run_reaches_max_steps_with_metrics(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    port = free_port()
    scd = ScdProcess(write_config(tmp_path, ray_address=session_ray, max_steps=400, port=port), "--max-steps", "40")
    scd_processes.append(scd)
    scd.wait_for_line("step 5 ")
    assert scrape(port, "/healthz") == "ok\n"
    text = scrape(port)
    assert metric(text, "scd_trainer_step") >= 5
    assert metric(text, "scd_weight_version") >= 5
    assert metric(text, "scd_committed_groups_total") >= 40
    assert metric(text, "scd_committed_tokens_total") > 0
    assert metric(text, "scd_generation_tokens_total") >= metric(text, "scd_committed_tokens_total")
    assert 'scd_ledger_prompts{state="consumed"}' in text
    assert "scd_replay_groups" in text
    assert scd.wait(timeout=300) == 0, scd.output()[-3000:]
    out = scd.output()
    assert "step 40 version 40" in out
    assert "step 41 " not in out


def test_a_metrics_port_in_use_exits_2_naming_it_before_ray_starts(tmp_path: Path,
                                                                    scd_processes: list[ScdProcess]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        scd = ScdProcess(write_config(tmp_path, port=port))
        scd_processes.append(scd)
        assert scd.wait(timeout=60) == 2, scd.output()[-3000:]
    out = scd.output()
    assert "scd: error: config key 'telemetry.metrics_port'" in out and f"127.0.0.1:{port}" in out
    assert "ray" not in out.lower() and "Traceback" not in out


def test_sigterm_drains_and_exits_zero_with_sd_notify(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    notify_path = tmp_path / "notify.sock"
    messages: list[str] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(0.1)
        listening = threading.Event()
        listening.set()

        def listen() -> None:  # as systemd does, all along
            while listening.is_set():
                with contextlib.suppress(TimeoutError):
                    messages.append(notify.recv(256).decode())

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        scd = ScdProcess(write_config(tmp_path, ray_address=session_ray, max_steps=100_000),
                         env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
        scd_processes.append(scd)
        scd.wait_for_line("step 3 ")
        time.sleep(0.5)
        sent = time.monotonic()
        scd.signal(signal.SIGTERM)
        assert scd.wait(timeout=60) == 0, scd.output()[-3000:]
        assert time.monotonic() - sent < 30
        time.sleep(0.3)
        listening.clear()
        listener.join(timeout=5)
    assert "shutdown requested" in scd.output()
    assert messages[0] == "READY=1"
    assert messages.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in messages


CHECKPOINT_EVERY_SECOND = "\n[checkpointing]\nenabled = true\ninterval_s = 1\nkeep_last = 3\n"


def test_sigkill_then_a_fresh_process_continues_from_the_checkpoint(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=CHECKPOINT_EVERY_SECOND)
    root = tmp_path / "out" / "checkpoints"
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("checkpoint step_")
    first.wait_for_line("step 5 ")
    first.kill_group()  # SIGKILL, mid-whatever it was doing
    bundles = layout.finalized_bundles(root)
    assert bundles, "no finalized bundle before the kill"
    k = layout.step_of(bundles[-1])
    assert k is not None

    second = ScdProcess(config, "--max-steps", str(k + 2))
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    out = second.output()
    assert f"restored {bundles[-1]}: step {k}," in out
    assert f"step {k + 1} version {k + 1} " in out and f"step {k + 2} version {k + 2} " in out
    assert f"step {k} version" not in out, "a restored step was trained again"
    final = layout.step_dir(root, k + 2)
    verify_bundle(final)
    events = [orjson.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    restores = [e for e in events if e["event"] == "restore"]
    assert restores and restores[-1]["step"] == k


def test_sigusr1_produces_a_new_finalized_bundle(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000,
                          extra="\n[checkpointing]\nenabled = true\ninterval_s = 3600\n")
    root = tmp_path / "out" / "checkpoints"
    scd = ScdProcess(config)
    scd_processes.append(scd)
    scd.wait_for_line("step 3 ")
    assert layout.finalized_bundles(root) == []
    scd.signal(signal.SIGUSR1)
    scd.wait_for_line("(signal)")
    [bundle] = layout.finalized_bundles(root)
    verify_bundle(bundle)
    # A drain at the same step would rightly skip its checkpoint (no_progress): let one step pass.
    scd.wait_for_line(f"step {layout.step_of(bundle) + 1} ")
    scd.signal(signal.SIGTERM)
    assert scd.wait(timeout=60) == 0, scd.output()[-3000:]
    assert "(shutdown)" in scd.output()
    assert len(layout.finalized_bundles(root)) == 2


def test_a_failed_last_checkpoint_exits_one_and_keeps_the_good_bundle(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100,
                          extra="\n[checkpointing]\nenabled = true\ninterval_s = 3600\n")
    root = tmp_path / "out" / "checkpoints"
    first = ScdProcess(config, "--max-steps", "2")
    scd_processes.append(first)
    assert first.wait(timeout=300) == 0, first.output()[-3000:]
    [good] = layout.finalized_bundles(root)
    before = tree_digest(root)
    second = ScdProcess(config, "--max-steps", "4", env={"SCD_FAULT": "mid_sidecar_write=enospc"})
    scd_processes.append(second)
    assert second.wait(timeout=300) == 1, second.output()[-3000:]
    out = second.output()
    assert "final checkpoint at step 4 failed (disk_full" in out
    assert f"newest good bundle is {good}" in out
    assert tree_digest(root) == before


def fetch(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_for_health(port: int, status: int, needle: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fetch(port, "/healthz")
        if got[0] == status and needle in got[1]:
            return
        time.sleep(0.2)
    raise AssertionError(f"/healthz never answered {status} {needle!r}; last: {got}")


def test_healthz_names_a_checkpoint_failure_streak_and_a_stalled_loop(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    port = free_port()
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, port=port,
                          extra="\n[checkpointing]\nenabled = true\ninterval_s = 3600\n")
    scd = ScdProcess(config, env={"SCD_FAULT": "mid_sidecar_write:1=enospc"})
    scd_processes.append(scd)
    scd.wait_for_line("step 3 ")
    assert fetch(port, "/readyz") == (200, "ready\n")
    assert fetch(port, "/healthz") == (200, "ok\n")

    scd.signal(signal.SIGUSR1)  # the first checkpoint hits the injected ENOSPC
    scd.wait_for_line("failed (disk_full")
    wait_for_health(port, 503, "unhealthy: checkpointing failed 1 time(s) in a row")
    scd.signal(signal.SIGUSR1)  # the next one succeeds and ends the streak
    wait_for_health(port, 200, "ok")

    os.kill(scd.proc.pid, signal.SIGSTOP)  # the event loop cannot run for 2 s
    time.sleep(2)
    os.kill(scd.proc.pid, signal.SIGCONT)
    wait_for_health(port, 503, "event loop fell")
    scd.signal(signal.SIGTERM)
    assert scd.wait(timeout=120) == 0, scd.output()[-3000:]


def run_to_the_end(config: Path, scd_processes: list[ScdProcess], *args: str) -> ScdProcess:
    scd = ScdProcess(config, *args)
    scd_processes.append(scd)
    scd.wait(timeout=300)
    return scd


def test_restoring_an_older_bundle_is_refused_unless_discard_newer_moves_the_newer_ones_aside(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    """Continuing from an older bundle forks the run; scd says so, and --discard-newer keeps the fork linear."""
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100,
                          extra="\n[checkpointing]\nenabled = true\ninterval_s = 3600\nkeep_last = 3\n")
    root = tmp_path / "out" / "checkpoints"
    for steps in ("2", "4"):
        first = run_to_the_end(config, scd_processes, "--max-steps", steps)
        assert first.proc.returncode == 0, first.output()[-3000:]
    older, newer = layout.step_dir(root, 2), layout.step_dir(root, 4)
    assert layout.finalized_bundles(root) == [older, newer]
    newer_digest, before = tree_digest(newer), tree_digest(root)

    # Refused with exit 2 (a usage error: every bundle is sound), before Ray starts, nothing changed.
    refused = run_to_the_end(config, scd_processes, "--restore-from", str(older), "--max-steps", "4")
    out = refused.output()
    assert refused.proc.returncode == 2, out[-3000:]
    assert "--restore-from" in out and newer.name in out and "--discard-newer" in out, out[-3000:]
    assert "Traceback" not in out and "TransferQueue" not in out
    assert tree_digest(root) == before  # so a plain restart resumes step 4, the run last run

    # With --discard-newer: the newer bundle is moved, whole, and the run's own step 4 is written.
    forked = run_to_the_end(config, scd_processes, "--restore-from", str(older), "--discard-newer",
                            "--max-steps", "4")
    out = forked.output()
    assert forked.proc.returncode == 0, out[-3000:]
    assert f"restored {older}: step 2," in out and "checkpoint step_00000004 (final)" in out, out[-3000:]
    assert "exists already" not in out
    [moved] = (root / layout.ABANDONED_DIR).iterdir()
    assert [p.name for p in moved.iterdir()] == [newer.name] and tree_digest(moved / newer.name) == newer_digest
    assert layout.finalized_bundles(root) == [older, newer] and tree_digest(newer) != newer_digest
    verify_bundle(newer)
    assert (root / layout.LATEST).read_text() == newer.name

    # The next plain restart resumes the run continued from step 2; retention never sees abandoned/.
    plain = run_to_the_end(config, scd_processes, "--max-steps", "5")
    out = plain.output()
    assert plain.proc.returncode == 0, out[-3000:]
    assert f"restored {newer}: step 4," in out, out[-3000:]
    assert [layout.step_of(b) for b in layout.finalized_bundles(root)] == [2, 4, 5]
    assert tree_digest(moved / newer.name) == newer_digest


def test_a_bundle_of_another_storage_unit_count_exits_3_naming_the_key_before_tq_loads(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    """The bundle comes from a run with its own Ray and two storage units; the refused run joins the worker's
    Ray, whose TQ has one unit (it must refuse before it touches that TQ)."""
    checkpointing = "\n[checkpointing]\nenabled = true\ninterval_s = 3600\n"
    one_unit = write_config(tmp_path, max_steps=100, extra=checkpointing, ray_address=session_ray).read_text()
    config = write_config(tmp_path, max_steps=100, extra=checkpointing)
    two_units = config.read_text().replace("[data_plane.ray]", "[data_plane]\nstorage_units = 2\n\n[data_plane.ray]")
    config.write_text(two_units)
    first = run_to_the_end(config, scd_processes, "--max-steps", "1")
    assert first.proc.returncode == 0, first.output()[-3000:]
    root = tmp_path / "out" / "checkpoints"
    [bundle] = layout.finalized_bundles(root)
    assert verify_bundle(bundle).info.storage_units == 2
    before = tree_digest(root)

    config.write_text(one_unit)
    second = run_to_the_end(config, scd_processes, "--max-steps", "2")
    out = second.output()
    assert second.proc.returncode == 3, out[-3000:]
    assert "data_plane.storage_units" in out and "2 storage unit(s)" in out and "data_plane.storage_units is 1" in out
    assert str(bundle) in out and "Traceback" not in out and "Storage unit count mismatch" not in out, out[-3000:]
    assert tree_digest(root) == before

    # A bundle written before scd recorded the count still says how many units its snapshot holds.
    info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
    del info["storage_units"]
    (bundle / layout.TRAINING_INFO_FILE).write_bytes(orjson.dumps(info))
    (bundle / layout.COMMIT_MARKER).write_text(layout.sha256_file(bundle / layout.TRAINING_INFO_FILE))
    verified = verify_bundle(bundle)
    assert verified.info.storage_units is None and storage_units_of(verified.info) == 2


def test_a_run_whose_dispatch_hangs_is_called_stalled_and_still_drains(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    """No silent stall: the 40th admission blocks forever (the tiny config's 32-group buffer then
    drains through training), so steps stop while the run serves; /healthz says so, the event log
    has one `stall` event for it, and a SIGTERM still drains cleanly.  A loaded box may also call the
    cold start stalled (no first step within 2 s); that stall ended with step 1, before the 40th
    admission could block, and is its own event."""
    port = free_port()
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, port=port)
    config.write_text(config.read_text().replace("[telemetry]\n", "[telemetry]\nstall_after_s = 2\n"
                                                                  "stall_after_steps = 5\n"))
    scd = ScdProcess(config, env={"SCD_FAULT": "before_dispatch:40=block"})
    scd_processes.append(scd)
    scd.wait_for_line("SCD_FAULT: blocking at before_dispatch")
    stalled_before = scd.output().count("training stalled")
    wait_for_health(port, 503, "unhealthy: no train step for ")
    scd.wait_for_line("training stalled", timeout=60, times=stalled_before + 1)
    scd.signal(signal.SIGTERM)
    assert scd.wait(timeout=120) == 0, scd.output()[-3000:]
    events = [orjson.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    stalls = [e for e in events if e["event"] == "stall"]
    steps = [e["step"] for e in events if e["event"] == "train_step"]
    hang = stalls[-1]
    assert steps and hang["step"] == steps[-1] and hang["limit_s"] >= 2 and hang["idle_s"] > hang["limit_s"]
    assert [e["step"] for e in stalls[:-1]] in ([], [0]), stalls  # one event per stall
