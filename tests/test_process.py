"""A real `scd run` subprocess: it reaches --max-steps, serves /metrics, and drains on SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
import urllib.request
from pathlib import Path

from tests.conftest import ScdProcess, free_port, write_config


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_run_reaches_max_steps_with_metrics(tmp_path: Path, scd_processes: list[ScdProcess]) -> None:
    port = free_port()
    scd = ScdProcess(write_config(tmp_path, max_steps=400, port=port), "--max-steps", "40")
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


def test_sigterm_drains_and_exits_zero_with_sd_notify(tmp_path: Path, scd_processes: list[ScdProcess]) -> None:
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(0.1)
        scd = ScdProcess(write_config(tmp_path, max_steps=100_000),
                         env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
        scd_processes.append(scd)
        scd.wait_for_line("step 3 ")
        time.sleep(0.5)
        sent = time.monotonic()
        scd.signal(signal.SIGTERM)
        assert scd.wait(timeout=60) == 0, scd.output()[-3000:]
        assert time.monotonic() - sent < 30
        messages = []
        with contextlib.suppress(TimeoutError):
            while True:
                messages.append(notify.recv(256).decode())
    assert "shutdown requested" in scd.output()
    assert messages[0] == "READY=1"
    assert messages.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in messages
