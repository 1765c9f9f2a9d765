"""A real Prometheus server scraping one target on loopback: Debian's binary, which the Makefile extracts into
``.tools/`` (``make test`` does it; nothing is installed system-wide)."""

from __future__ import annotations

import functools
import os
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from scd.rewards.worker import die_with

BINARY = Path(__file__).resolve().parents[2] / ".tools" / "prometheus"


class Prometheus:
    """Scrapes ``127.0.0.1:target_port`` every second; stopped by pid, and killed by the kernel if the test
    process dies first."""

    def __init__(self, directory: Path, port: int, target_port: int) -> None:
        assert BINARY.exists(), f"{BINARY} is missing: `make test` extracts Debian's prometheus there"
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          "scrape_configs:\n  - job_name: scd\n    static_configs:\n"
                          f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = directory / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(BINARY), f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=functools.partial(die_with, os.getpid()))

    def _get(self, path: str, **params: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as response:
            return orjson.loads(response.read())

    def wait_for_scrapes(self, count: int, timeout: float = 60) -> None:
        """Until the target has answered ``count`` scrapes (``rate`` needs two samples in its range)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                samples = self.query("sum_over_time(up[1h])")
            except OSError:
                samples = []
            if samples and float(samples[0]["value"][1]) >= count:
                return
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"fewer than {count} scrapes: {self.log_path.read_text()[-3000:]}"
            time.sleep(0.5)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant query's result vector."""
        answer = self._get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
