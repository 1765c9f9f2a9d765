"""The shipped unit file: Type=notify, a watchdog, SIGUSR1 on reload, hardening that keeps scd working."""

from __future__ import annotations

import configparser
import socket
import time
from pathlib import Path

import pytest

from scd import systemd
from tests.conftest import REPO


def test_unit_file() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(REPO / "systemd" / "scd.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert "-USR1" in service["ExecReload"]
    assert service["Restart"] == "on-failure"
    assert "AF_UNIX" in service["RestrictAddressFamilies"]
    assert "scd run" in service["ExecStart"]
    assert service["ProtectSystem"] == "strict" and service["ReadWritePaths"]


def test_a_listener_that_stops_reading_never_blocks_notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """notify runs on the event loop: a full socket queue once stopped the whole controller for a minute."""
    path = tmp_path / "notify.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        started = time.monotonic()
        sent = [systemd.notify("WATCHDOG=1") for _ in range(5000)]  # far more than a queue holds
        assert time.monotonic() - started < 5
        assert sent[0] and not sent[-1]  # the first went through; once full, dropped instead of waiting
        assert listener.recv(64) == b"WATCHDOG=1"
