"""Writing a partial bench run's figures into bench/results/summary.json and printing them against goals."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import orjson

RESULTS = Path(__file__).resolve().parent / "results"


async def probe_loop(stalls: list[float]) -> None:
    """How late the loop wakes a 10 ms sleep, appended to ``stalls`` until cancelled."""
    while True:
        before = time.monotonic()
        await anyio.sleep(0.01)
        stalls.append(time.monotonic() - before - 0.01)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def merge_and_print(summary: dict[str, float], goals: dict[str, tuple[str, float]]) -> None:
    """Add ``summary``'s keys to the committed summary (every other key kept) and print each against its goal."""
    path = RESULTS / "summary.json"
    merged = orjson.loads(path.read_bytes()) if path.exists() else {}
    merged |= summary
    path.write_bytes(orjson.dumps(merged, option=orjson.OPT_INDENT_2))
    for key, value in summary.items():
        mark = ""
        if key in goals:
            op, bound = goals[key]
            mark = f"{op} {bound:g}  {'met' if (value >= bound if op == '>=' else value <= bound) else 'MISSED'}"
        print(f"{key:52s} {value:14.4f}  {mark}")
