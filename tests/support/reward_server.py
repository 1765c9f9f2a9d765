"""A remote reward service on loopback, as its own process, so a test can take it down and bring it back:
``python -m tests.support.reward_server PORT LOG`` (``RewardService`` starts and stops it).

Each item scores ``len(completion) / 10``; every item it answered is appended to LOG as a JSON line
(its row and completion), so a test can count what was scored, and how often.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

_written = threading.Lock()
_REPO = Path(__file__).resolve().parents[2]


def serve(port: int, log: Path) -> None:
    class Score(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            items = orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            body = orjson.dumps({"rewards": [len(item["completion"]) / 10 for item in items]})
            with _written, log.open("ab") as out:
                out.write(b"".join(orjson.dumps({"row": i["row"], "completion": i["completion"]}) + b"\n"
                                   for i in items))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", port), Score) as server:
        print("serving", flush=True)
        server.serve_forever()


class RewardService:
    """This module's server as its own process on a fixed loopback port: down and up again at will (while it
    is down nothing listens there: a connection is refused)."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.reward_server", str(self.port),
                                         str(self.log)], cwd=_REPO, stdout=subprocess.PIPE)
        assert self.process.stdout is not None and self.process.stdout.readline() == b"serving\n"

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process = None

    def items(self) -> list[dict[str, Any]]:
        """Every item it answered, in order, across its starts (while ``log`` stays the same)."""
        return [orjson.loads(line) for line in self.log.read_bytes().splitlines()] if self.log.exists() else []


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
