"""Waiting on a condition from a test's own thread, with a deadline that names what never came."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], object], timeout: float, what: str, poll_s: float = 0.2) -> None:
    """Until ``check()`` is true; fails after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(poll_s)
