"""Writing a partial bench run's figures into bench/results/summary.json and printing them against goals."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

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


Bench = Callable[[Path], Awaitable[dict[str, float]]]


async def run_standalone(benches: Sequence[tuple[str, Bench]], goals: dict[str, tuple[str, float]]) -> None:
    """``python -m bench.<module>``: ``benches`` on a Ray and TQ of their own, in a scratch directory under
    bench/, their figures merged into the committed summary and printed against ``goals``."""
    import ray
    import transfer_queue as tq

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.2",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    summary: dict[str, float] = {}
    try:
        with TemporaryDirectory(dir=RESULTS.parent) as tmp_name:
            for name, bench in benches:
                started = time.monotonic()
                summary |= await bench(Path(tmp_name))
                print(f"[{name}: {time.monotonic() - started:.0f}s]", flush=True)
    finally:
        tq.close()
        ray.shutdown()
    merge_and_print(summary, goals)
