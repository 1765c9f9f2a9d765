"""What scd writes and loads, and what it exposes."""

from __future__ import annotations

import ast
import socket
import time
from pathlib import Path

import anyio

from scd.systemd import feed_watchdog
from tests.conftest import REPO


def scd_sources() -> list[Path]:
    return sorted((REPO / "scd").rglob("*.py"))


def test_torch_load_only_with_weights_only_and_no_pickle_in_scd() -> None:
    loads = 0
    for path in scd_sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "dill", "cloudpickle") for n in names), path
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                loads += 1
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("weights_only") == "True", f"{path}: {ast.unparse(node)}"
    assert loads >= 2


async def test_watchdog_is_fed_by_the_event_loop_and_stops_when_it_is_stuck(tmp_path: Path,
                                                                           monkeypatch) -> None:
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
        monkeypatch.setenv("WATCHDOG_USEC", "100000")  # feed every 50 ms

        def drain() -> int:
            n = 0
            while True:
                try:
                    assert sock.recv(64) == b"WATCHDOG=1"
                except BlockingIOError:
                    return n
                n += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(feed_watchdog)
            await anyio.sleep(0.5)
            fed_while_live = drain()
            time.sleep(0.5)  # the event loop is stuck: nothing may feed the watchdog meanwhile
            fed_while_stuck = drain()
            tg.cancel_scope.cancel()
    assert fed_while_live >= 5
    assert fed_while_stuck == 0


def test_metrics_bind_loopback_by_default() -> None:
    from scd.config import TelemetryConfig

    assert TelemetryConfig().metrics_host == "127.0.0.1"
