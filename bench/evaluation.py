"""Held-out evaluation's cost to training, and the cost of an export.

``eval_overhead``: the chat example's task and shape (configs/chat-task.toml: 16 prompts x 16 completions
a step, its 64 held-out prompts x 4 samples) on the torch backend and the tests' tiny Llama, trained
with ``eval.every_steps = 10`` and without ``[eval]``, in interleaved pairs (off, on, off, on, ...) so
drift of the box hits both alike.  Checkpointing is on in both, as users run it (the example's
``interval_s = 120``): the eval's cost includes the checkpoint that follows each eval (which holds its
result until it is reported), and each run's last checkpoint is in both.  Throughput is trainer steps/s
over ``STEPS`` steps after a warm-up of ``WARMUP`` steps, both multiples of ``every_steps``: the window holds
one eval per ``every_steps`` steps, its last step's eval being the one due there anyway (a window ending
between two would add the run's last-step eval, an eval users pay once a run, to 40 steps);
``eval_overhead_ratio`` is the median of the pairs' on ÷ off, its spread max - min.  Goal: >= 0.85.

``export_seconds_100m``: ``scd export`` of a bundle of a 104M-parameter Llama (hidden 768, 11 layers),
written by a one-step run: the median of ``EXPORTS`` exports, each to a new directory.

``python -m bench.evaluation`` runs only these and merges their keys into bench/results/summary.json.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import anyio
from prometheus_client import REGISTRY

from bench.commits import clear
from bench.configs import REPO
from bench.summary import run_standalone
from scd.checkpoint import layout
from scd.checkpoint.export import export_bundle
from scd.config import Config, derive_config
from scd.daemon import Controller
from scd.model.init_tiny import TinyLlamaShape, init_tiny

STEPS, WARMUP, PAIRS, EXPORTS, EVERY_STEPS = 40, 10, 5, 3, 10
SHAPE_100M = TinyLlamaShape(hidden_size=768, num_layers=11, num_heads=12)
GOALS = {"eval_overhead_ratio": (">=", 0.85)}
CONFIGS = REPO / "configs"  # the chat example's reward module is named relative to its config


def chat_config(tmp: Path, model: Path, *, evaluate: bool, **sections: dict[str, object]) -> Config:
    layers: dict[str, dict[str, object]] = {
        "run": {"output_dir": str(tmp)}, "telemetry": {"metrics_port": 0}, "model": {"name": str(model)},
        "generation": {"backend": "torch"}, "data_plane": {"partition": "bench-eval"},
        "eval": {"every_steps": EVERY_STEPS, "at_start": False} if evaluate else {"path": ""}, **sections}
    return derive_config(REPO / "configs" / "chat-task.toml", layers)


def eval_seconds() -> float:
    return REGISTRY.get_sample_value("scd_eval_seconds_total") or 0.0


async def steps_per_s(config: Config) -> tuple[float, int, float]:
    """Trainer steps/s over STEPS steps after WARMUP, the evaluations made within them and their seconds."""
    await clear(config.data_plane.partition)
    async with Controller.open(config, config_dir=CONFIGS) as controller:
        await controller.run(max_steps=WARMUP)
        evaluated, seconds = len(controller.state.evaluated_steps), eval_seconds()
        started = time.monotonic()
        await controller.run(max_steps=WARMUP + STEPS)
        made = len(controller.state.evaluated_steps) - evaluated
        return STEPS / (time.monotonic() - started), made, eval_seconds() - seconds


async def eval_overhead(tmp: Path) -> dict[str, float]:
    model = init_tiny(tmp / "eval-llama")
    ratios, offs, ons, evals, seconds = [], [], [], [], []
    for pair in range(PAIRS):
        off, _, _ = await steps_per_s(chat_config(tmp / f"eval-off{pair}", model, evaluate=False))
        on, made, evaluating = await steps_per_s(chat_config(tmp / f"eval-on{pair}", model, evaluate=True))
        ratios.append(on / off)
        offs.append(off)
        ons.append(on)
        evals.append(made)
        seconds.append(evaluating / made)
    return {"eval_overhead_ratio": statistics.median(ratios), "eval_overhead_ratio_spread": max(ratios) - min(ratios),
            "eval_overhead_pairs": len(ratios), "eval_steps_per_s_off": statistics.median(offs),
            "eval_steps_per_s_on": statistics.median(ons), "eval_evaluations_per_run": statistics.median(evals),
            "eval_seconds_per_eval": statistics.median(seconds)}


async def export_seconds(tmp: Path) -> dict[str, float]:
    model = init_tiny(tmp / "llama-100m", SHAPE_100M)
    config = chat_config(tmp / "export-run", model, evaluate=False, trainer={"groups_per_step": 2},
                         generation={"backend": "torch", "group_size": 2})
    await clear(config.data_plane.partition)
    async with Controller.open(config, config_dir=CONFIGS) as controller:
        await controller.run(max_steps=1)
    bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
    seconds = []
    for attempt in range(EXPORTS):
        started = time.monotonic()
        await anyio.to_thread.run_sync(export_bundle, bundle, tmp / f"export-{attempt}")
        seconds.append(time.monotonic() - started)
    return {"export_seconds_100m": statistics.median(seconds),
            "export_seconds_100m_spread": max(seconds) - min(seconds),
            "export_bundle_model_mib_100m": (bundle / layout.MODEL_FILE).stat().st_size / 2**20}


async def main() -> None:
    await run_standalone((("eval_overhead", eval_overhead), ("export_seconds", export_seconds)), GOALS)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
