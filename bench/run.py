"""`make bench`: measure the embedded default and write JSON under bench/results/.

Benchmarks, not tests: they report numbers and never fail on them.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
import tomllib
from pathlib import Path
from tempfile import TemporaryDirectory

import anyio
import orjson

from scd.config import parse_config
from scd.daemon import Controller

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def tiny(tmp: Path, **overrides: dict[str, object]) -> object:
    data = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())
    data["run"]["output_dir"] = str(tmp)
    data["telemetry"]["metrics_port"] = 0
    for section, values in overrides.items():
        data[section].update(values)
    return parse_config(data, REPO / "configs")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def throughput(warmup_steps: int = 10, steps: int = 100) -> dict[str, float]:
    """Steps, committed groups and tokens per second, and event-loop stall, on configs/tiny.toml."""
    with TemporaryDirectory() as tmp:
        config = tiny(Path(tmp))
        async with Controller.open(config) as controller:
            await controller.run(max_steps=warmup_steps)
            stalls: list[float] = []

            async def probe() -> None:
                while True:
                    before = time.monotonic()
                    await anyio.sleep(0.01)
                    stalls.append(time.monotonic() - before - 0.01)

            groups0, tokens0 = controller.committed_groups, controller.backend.generated_tokens()
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(probe)
                await controller.run(max_steps=warmup_steps + steps)
                tg.cancel_scope.cancel()
            elapsed = time.monotonic() - started
            return {
                "steps_per_s": steps / elapsed,
                "committed_groups_per_s": (controller.committed_groups - groups0) / elapsed,
                "generated_tokens_per_s": (controller.backend.generated_tokens() - tokens0) / elapsed,
                "loop_stall_p50_ms": 1000 * statistics.median(stalls),
                "loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
                "loop_stall_max_ms": 1000 * max(stalls),
                "measured_steps": steps,
            }


async def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {"throughput": await throughput()}
    meta = {"time": time.time(), "python": platform.python_version(), "machine": platform.machine()}
    for name, values in results.items():
        (RESULTS / f"{name}.json").write_bytes(orjson.dumps({**values, "meta": meta}, option=orjson.OPT_INDENT_2))
        print(f"{name}:")
        for key, value in values.items():
            print(f"  {key:28s} {value:12.3f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
