"""sd_notify over a plain AF_UNIX datagram socket (no libsystemd)."""

from __future__ import annotations

import logging
import os
import socket

import anyio

log = logging.getLogger(__name__)
_dropped = 0  # notifications a full socket refused


def notify(message: str) -> bool:
    """Send ``message`` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd.

    Never blocks: it is called from the event loop, and a listener that stops reading fills its socket's
    queue; a blocking send would then stop the whole controller.  A message the full queue refuses is
    dropped (logged the first time), as a late watchdog ping is for systemd anyway."""
    global _dropped
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(message.encode(), socket.MSG_DONTWAIT, address)
        except BlockingIOError:
            _dropped += 1
            if _dropped == 1:
                log.warning("sd_notify: %s's queue is full (the listener is not reading): %r dropped, and any "
                            "further message it refuses", address, message)
            return False
    return True


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds, if systemd asked for keep-alives for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def feed_watchdog() -> None:
    """WATCHDOG=1 at half of $WATCHDOG_USEC, from the event loop: a stuck loop stops feeding it."""
    interval = watchdog_interval_s()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await anyio.sleep(interval)
