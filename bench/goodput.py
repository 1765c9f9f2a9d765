"""Goodput: engines as busy as the staleness window allows, and nothing generated only to be thrown away.

``regimes``: a daemon on the synthetic engine in each regime, train-bound (R_g > R_t: its bound
is R_t / R_g) and then generation-bound (R_g < R_t: the engine is the bottleneck, its bound is 1),
the engine's rate set to a third of the trainer's rate the train-bound run measured, so that the
regime holds however busy the machine is.
After a warm-up, the engine's busy ratio is measured from its own clock over a steady span, and
divided by ``scd_engine_busy_bound`` as scd estimated it live over that same span (goal >= 0.95);
the waste ratio is the run's (goal <= 0.01).

``crash_loop``: real ``scd run`` processes in the tests' config (8 groups a step, window 1, a
buffer of 64) on a fast synthetic engine, SIGKILLed at seeded random moments at least 8 times,
then run to the end; the waste is summed over every process and restore (``goodput_totals``, what
``scd report`` shows), with admission paced (goal <= 0.05) and, for the figure before pacing, not.

``python -m bench.goodput`` runs only these and merges their keys into bench/results/summary.json.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from bench.configs import tiny
from bench.summary import run_standalone
from scd.checkpoint import layout
from scd.config import Config
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.report import goodput_totals

REPO = Path(__file__).resolve().parents[1]
GOALS = {
    **{f"goodput_{regime}_busy_vs_bound": (">=", 0.95) for regime in ("generation_bound", "train_bound")},
    **{f"goodput_{regime}_waste_ratio": ("<=", 0.01) for regime in ("generation_bound", "train_bound")},
    "goodput_crash_loop_waste_ratio": ("<=", 0.05),
}
# Completions are long (96 tokens) so that training, not the per-group cost of a commit, is what
# limits the train-bound run: there the engine makes a step's groups (16 of 8 siblings) in 25 ms.
COMPLETION_TOKENS = 96
TRAIN_BOUND_TOKENS_PER_S = 500_000.0
GENERATION_BOUND_SHARE = 1 / 3  # of the trainer's rate
WARM_UP_S = 15.0
MEASURE_S = 45.0
CRASH_KILLS = 8
CRASH_TOKENS_PER_S = 50_000.0


async def regime(tmp: Path, name: str, tokens_per_s: float) -> dict[str, float]:
    config: Config = tiny(
        tmp / f"goodput-{name}", partition=f"bench-goodput-{name}", model={"max_len": 128},
        generation={"backend": "synthetic", "max_inflight_prompts": 32, "max_new_tokens": COMPLETION_TOKENS,
                    "synthetic": {"tokens_per_s": tokens_per_s, "min_completion_tokens": COMPLETION_TOKENS,
                                  "max_completion_tokens": COMPLETION_TOKENS, "batch_groups": 4,
                                  "max_concurrent_batches": 4}},
        # scd's estimate of the bound at the end spans the measured seconds exactly.
        telemetry={"goodput_window_s": MEASURE_S})
    await DataPlane(config.data_plane).clear_all()
    async with Controller.open(config) as controller:
        measured: dict[str, Any] = {}

        async def measure(cancel: anyio.CancelScope) -> None:
            await anyio.sleep(WARM_UP_S)
            first, started = controller.backend.engine_activity(), time.monotonic()
            await anyio.sleep(MEASURE_S)
            last, elapsed = controller.backend.engine_activity(), time.monotonic() - started
            measured["busy"] = sum(b.busy_seconds - a.busy_seconds for a, b in zip(first, last, strict=True)) \
                / (elapsed * len(last))
            measured["reading"] = controller.goodput.sample()
            cancel.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(measure, tg.cancel_scope)
            await controller.run(max_steps=1_000_000)
    await DataPlane(config.data_plane).clear_all()
    reading = measured["reading"]
    assert reading.engine_busy_bound is not None, "no bound estimated: no train step in the measured span"
    return {
        f"goodput_{name}_busy_vs_bound": measured["busy"] / reading.engine_busy_bound,
        f"goodput_{name}_busy_ratio": measured["busy"],
        f"goodput_{name}_busy_bound": reading.engine_busy_bound,
        f"goodput_{name}_trainer_groups_per_s": reading.trainer_groups_per_s or 0.0,
        f"goodput_{name}_generation_groups_per_s": reading.generation_groups_per_s or 0.0,
        f"goodput_{name}_waste_ratio": reading.waste_ratio,
        f"goodput_{name}_goodput_ratio": reading.goodput_ratio,
    }


async def regimes(tmp: Path) -> dict[str, float]:
    out = await regime(tmp, "train_bound", TRAIN_BOUND_TOKENS_PER_S)
    tokens_per_group = 8 * COMPLETION_TOKENS  # configs/tiny.toml's group_size
    trainer_tokens_per_s = out["goodput_train_bound_trainer_groups_per_s"] * tokens_per_group
    return out | await regime(tmp, "generation_bound", GENERATION_BOUND_SHARE * trainer_tokens_per_s)


CRASH_CONFIG = """
[run]
seed = 0
max_steps = 100000
output_dir = "{out}"
[data_plane.ray]
num_cpus = 3
[generation]
backend = "synthetic"
group_size = 8
max_inflight_prompts = 16
[generation.synthetic]
tokens_per_s = {tokens_per_s}
min_completion_tokens = 4
max_completion_tokens = 4
batch_groups = 4
max_concurrent_batches = 4
[trainer]
groups_per_step = 8
[task]
name = "reverse"
size = 64
[async_rl]
buffer_capacity_groups = 64
pace_admission = {paced}
[async_rl.sampler]
name = "windowed"
max_staleness_versions = 1
[checkpointing]
enabled = true
interval_s = 0.5
keep_last = 3
[telemetry]
metrics_port = 0
"""


def _scd_run(config: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """`scd run` in a process group of its own, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "scd.cli", "run", str(config), *args], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _kill_after_first_step(config: Path, log: Path, delay_s: float) -> None:
    """SIGKILL a run (and the Ray it started) ``delay_s`` after its first train step."""
    proc = _scd_run(config, log)
    try:
        deadline = time.monotonic() + 300
        while b" reward " not in log.read_bytes() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(delay_s)
    finally:
        _kill_group(proc)


def crash_loop(tmp: Path, paced: bool, kills: int = CRASH_KILLS) -> dict[str, float]:
    """``kills`` SIGKILLs at seeded random moments, then a run to 20 steps past the last bundle."""
    directory = tmp / f"crash-loop-{'paced' if paced else 'unpaced'}"
    directory.mkdir(parents=True)
    config = directory / "scd.toml"
    config.write_text(CRASH_CONFIG.format(out=directory / "out", tokens_per_s=CRASH_TOKENS_PER_S,
                                          paced=str(paced).lower()))
    rng = random.Random(1234)
    for kill in range(kills):
        # Each process's log starts empty, so the first train step it waits for is its own.
        _kill_after_first_step(config, directory / f"scd-{kill}.log", rng.uniform(0.5, 3.0))
    root = directory / "out" / "checkpoints"
    final_step = (layout.step_of(layout.finalized_bundles(root)[-1]) or 0) + 20
    final = _scd_run(config, directory / "scd-final.log", "--max-steps", str(final_step))
    try:
        assert final.wait(timeout=600) == 0, (directory / "scd-final.log").read_text()[-3000:]
    finally:
        _kill_group(final)
    totals = goodput_totals(directory / "out" / "events.jsonl")
    name = "goodput_crash_loop" if paced else "goodput_crash_loop_before_pacing"
    return {f"{name}_waste_ratio": totals.waste_ratio, f"{name}_goodput_ratio": totals.goodput_ratio,
            f"{name}_kills": kills, f"{name}_final_step": final_step,
            f"{name}_restore_stale_groups": totals.restore_stale_groups,
            f"{name}_restore_stale_tokens": totals.restore_stale_tokens}


async def crash_loops(tmp: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for paced in (True, False):
        out |= await anyio.to_thread.run_sync(crash_loop, tmp, paced)
    return out


async def main() -> None:
    await run_standalone((("goodput_regimes", regimes), ("goodput_crash_loop", crash_loops)), GOALS)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
