"""The JSONL event log: one object per line, stamped with wall-clock time and trainer step.

Appended across restarts, so a series continues where the last process left it.
Records are stamped and written one at a time, so the file is in time order.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiofiles
import anyio
import orjson


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = anyio.Lock()

    async def emit(self, event: str, step: int, **fields: Any) -> None:
        async with self._lock:
            record = {"event": event, "time": time.time(), "step": step, **fields}
            async with aiofiles.open(self.path, "ab") as f:
                await f.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n")
