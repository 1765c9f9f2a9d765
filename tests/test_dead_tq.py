"""A hung TransferQueue: calls time out, and scd reports it and exits non-zero instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scd import cli
from scd.cluster import AbandonedCalls
from tests.conftest import ScdProcess, write_config


def storage_unit_pids(scd_pid: int) -> list[int]:
    """TQ storage actors descended from this test's scd (Ray workers lead their own process groups)."""
    ps = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    parent, args = {}, {}
    for line in ps.splitlines():
        pid, ppid, command = [*line.strip().split(None, 2), ""][:3]
        parent[int(pid)], args[int(pid)] = int(ppid), command

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == scd_pid:
                return True
            pid = parent.get(pid, 1)
        return False

    return [pid for pid, command in args.items() if "SimpleStorageUnit" in command and descends(pid)]


def test_hung_tq_times_out_and_exits_non_zero(tmp_path: Path, scd_processes: list[ScdProcess]) -> None:
    config = write_config(tmp_path, max_steps=100_000)
    config.write_text(config.read_text().replace("[data_plane.ray]", "[data_plane]\ncall_timeout_s = 3\n\n"
                                                                     "[data_plane.ray]"))
    scd = ScdProcess(config)
    scd_processes.append(scd)
    scd.wait_for_line("step 3 ")
    units = storage_unit_pids(scd.proc.pid)
    assert units, "no TQ storage actor found in scd's process group"
    for pid in units:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    code = scd.wait(timeout=90)
    assert code == 1, scd.output()[-3000:]
    assert time.monotonic() - stopped < 60
    assert "timed out after" in scd.output(), scd.output()[-6000:]
    assert "is TQ (Ray) alive?" in scd.output(), scd.output()[-6000:]


def test_main_returns_its_code_in_process_even_after_an_abandoned_call(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the `scd` command leaves with os._exit after a call it abandoned (above); `cli.main`, which tests
    and embedders call in their own process, returns."""
    monkeypatch.setattr(AbandonedCalls, "count", 1)
    assert cli.main(["checkpoint", "list", str(tmp_path)]) == 0
