"""A remote reward service on loopback, as its own process, so a test can take it down and bring it back:
``python -m tests.support.reward_server PORT LOG``.

Each item scores ``len(completion) / 10``; every item it answered is appended to LOG as a JSON line
(its row and completion), so a test can count what was scored, and how often.
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson

_written = threading.Lock()


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


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
