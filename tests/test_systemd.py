"""The shipped unit file: Type=notify, a watchdog, SIGUSR1 on reload, hardening that keeps scd working."""

from __future__ import annotations

import configparser

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
