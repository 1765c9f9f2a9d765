"""A minimal HTTP/1.1 server for /metrics, /healthz and /readyz, served inside the event loop.

``/healthz`` answers 200 ``ok`` or 503 with the reason the process is unhealthy (a liveness probe: a restart
would help); ``/readyz`` answers 200 once the controller serves (restore done, pumps running), and 503 with
the reason while it waits on something outside it (a reward's service down: a restart would not help).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.abc import SocketListener, SocketStream, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from scd.errors import ConfigError

log = logging.getLogger(__name__)


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def open_listener(host: str, port: int) -> SocketListener:
    """Bind ``host:port`` (0 = any free port).

    The daemon binds before Ray or an engine starts: their processes take free ports of
    their own, so a port bound later may be gone by then.
    """
    try:
        return await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    except OSError as exc:
        raise ConfigError("telemetry.metrics_port",
                          f"cannot listen on {host}:{port} ({exc.strerror or exc}); is another scd or "
                          "another program using it? Pick another port, or 0 for any free one") from None


def _waiting_on_nothing() -> str:
    return ""


async def serve_http(
    listener: SocketListener, health_problem: Callable[[], str], ready: Callable[[], bool],
    outage: Callable[[], str] = _waiting_on_nothing, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on ``listener`` until cancelled; reports its port through ``task_status``.  ``outage``: what the
    serving controller waits for outside it ("" when nothing), which /readyz answers 503 with."""
    host, bound = listener.extra(anyio.abc.SocketAttribute.local_address)[:2]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    task_status.started(bound)

    async def handle(stream: SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(10):
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < 8192:
                        request += await stream.receive(4096)
                parts = request.split(b" ", 2)
                path = parts[1].decode(errors="replace") if len(parts) > 1 else ""
                if path.split("?")[0] == "/metrics":
                    body = await anyio.to_thread.run_sync(generate_latest, REGISTRY)
                    await stream.send(_response("200 OK", CONTENT_TYPE_LATEST, body))
                elif path == "/healthz":
                    problem = health_problem()
                    await stream.send(_response("503 Service Unavailable", "text/plain",
                                                f"unhealthy: {problem}\n".encode()) if problem
                                      else _response("200 OK", "text/plain", b"ok\n"))
                elif path == "/readyz":
                    waiting = outage() if ready() else "not serving"
                    await stream.send(_response("503 Service Unavailable", "text/plain",
                                                f"not ready: {waiting}\n".encode()) if waiting
                                      else _response("200 OK", "text/plain", b"ready\n"))
                else:
                    await stream.send(_response("404 Not Found", "text/plain", b"not found\n"))
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError, OSError):
                return

    async with listener:
        await listener.serve(handle)
