"""The trainer at world size 2 (two FSDP2 ranks on Ray, gloo) against world size 1 (scd's process).

``trainer_steps_ratio_tis_vs_none``: train steps/s at world size 1 with ``off_policy_correction = "tis"`` ÷
``"none"`` on the same batches, interleaved pairs, median and spread: at one optimizer step a train step the
proximal logprobs are the step's own forward, detached, so this is the correction's arithmetic alone.
``trainer_steps_ratio_mini_batches2_vs_1``: ``trainer.mini_batches = 2`` ÷ 1 (both ``"tis"``): the proximal
forward without gradients over the second mini-batch's rows and the second optimizer step.

``trainer_world2_vs_world1_steps_ratio``: train steps/s at world size 2 ÷ world size 1 on the tiny
Llama, interleaved (1 2 1 2 ...), the median of the per-pair ratios and their spread.  On a 2-core
box both ranks share the cores the single trainer had, so this measures the group's overhead
(Ray calls, the rows shipped to the ranks, gloo's collectives), not a speed-up.

At a Llama of about 95M parameters whose output head is its embedding (tied, as Qwen2.5-0.5B's; hidden
768, 12 layers, vocabulary 32,000):

* ``weight_export_ms_100m_world{1,2}``: a whole weight sync's read of every tensor of
  ``live_weights()`` into a host buffer, as a generation backend reads it: at world size 1 the
  trainer's own tensors, at 2 a decoder layer at a time gathered from the shards on rank 0.
  ``weight_export_world2_vs_world1_ratio_100m``: the one ÷ the other (goal 5).  ``..._bf16``: the same
  with ``model.dtype = "bfloat16"`` over fp32 masters, each rank casting its shards before the gather
  (world size 1 casts its masters).
* ``trainer_state_capture_ms_100m``: a checkpoint's state capture at world size 2, until every
  rank holds its part: the train pump does not wait for it (``..._submit_ms``: what it does wait
  for), but the next step starts on the ranks after it.  ``trainer_state_write_ms_100m``: the
  capture and rank 0's write of the bundle's two files, on a thread of rank 0's own, which the
  checkpoint writer waits for off the critical path.  ``..._world1``: the copy to host memory a
  trainer in scd's process makes while the pump waits.

``python -m bench.trainer_group`` runs only these and merges their keys into bench/results/summary.json.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import anyio
import torch

from bench.summary import merge_and_print
from bench.trainer_memory import write_tied_llama
from scd.config import Config, derive_config
from scd.model.init_tiny import init_tiny
from scd.model.policy import build_policy
from scd.model.weights import unaliased
from scd.records import Rollout
from scd.training.group import TrainerGroup
from scd.training.grpo import GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
GROUPS, ROWS, PAIRS, STEPS = 8, 8, 4, 6
GOALS = {"weight_export_world2_vs_world1_ratio_100m": ("<=", 5.0)}


def config(tmp: Path, model: Path, world_size: int, dtype: str = "float32", **trainer: object) -> Config:
    return derive_config(REPO / "configs" / "tiny.toml", {"run": {"output_dir": str(tmp)}}, {
        "model": {"name": str(model), "dtype": dtype}, "data_plane": {"ray": {"num_cpus": 5}},
        "trainer": {"world_size": world_size, "groups_per_step": GROUPS, **trainer}})


def batch(seed: int) -> list[list[Rollout]]:
    generator = torch.Generator().manual_seed(seed)
    return [[Rollout(torch.randint(4, 50, (13,), generator=generator), -torch.rand(8, generator=generator), 5,
                     reward=float(torch.rand((), generator=generator)), weight_version=0)
             for _ in range(ROWS)] for _ in range(GROUPS)]


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def read_all(weights: Any) -> None:
    """Every tensor a sync sends (``unaliased``: a tied one once) into a host buffer of its own, in order: a
    backend's read of a sync."""
    sent = unaliased(weights)
    for name in sent:
        torch.empty_like(sent[name], device="cpu").copy_(sent[name])


async def steps_ratio(tmp: Path, model: Path) -> dict[str, float]:
    one = GRPOTrainer(config(tmp, model, 1), build_policy(config(tmp, model, 1).model, 0))
    ratios, rates = [], {1: [], 2: []}
    async with TrainerGroup.open(config(tmp, model, 2)) as two:
        await anyio.to_thread.run_sync(two.step, batch(0), 0)  # warm-up: the first step builds state
        one.step(batch(0), 0)
        for pair in range(PAIRS):
            per_s = {}
            for world, step in ((1, one.step), (2, two.step)):
                span = await anyio.to_thread.run_sync(
                    timed, lambda step=step, first=pair * STEPS: [step(batch(first + i), 0) for i in range(STEPS)])
                per_s[world] = STEPS / span
                rates[world].append(per_s[world])
            ratios.append(per_s[2] / per_s[1])
    return {"trainer_world2_vs_world1_steps_ratio": statistics.median(ratios),
            "trainer_world2_vs_world1_steps_ratio_spread": max(ratios) - min(ratios),
            "trainer_world1_steps_per_s": statistics.median(rates[1]),
            "trainer_world2_steps_per_s": statistics.median(rates[2])}


def interleaved_steps_ratio(tmp: Path, model: Path, name: str, base: dict[str, Any],
                            other: dict[str, Any]) -> dict[str, float]:
    """World size 1: train steps/s under the trainer keys ``other`` ÷ ``base``, interleaved pairs on the same
    batches, as ``name`` and ``name_spread`` (blocking)."""
    trainers = [GRPOTrainer(c, build_policy(c.model, 0)) for c in (config(tmp, model, 1, **base),
                                                                    config(tmp, model, 1, **other))]
    for trainer in trainers:  # warm-up: the first step builds the optimizer state
        trainer.step(batch(0), 0)
    ratios = []
    for pair in range(PAIRS):
        per_s = [STEPS / timed(lambda t=trainer, first=pair * STEPS: [t.step(batch(first + i), 0)
                                                                       for i in range(STEPS)])
                 for trainer in trainers]
        ratios.append(per_s[1] / per_s[0])
    return {name: statistics.median(ratios), f"{name}_spread": max(ratios) - min(ratios)}


def correction_costs(tmp: Path, model: Path) -> dict[str, float]:
    tis = {"loss": {"off_policy_correction": "tis"}}
    return {**interleaved_steps_ratio(tmp, model, "trainer_steps_ratio_tis_vs_none",
                                      {"loss": {"off_policy_correction": "none"}}, tis),
            **interleaved_steps_ratio(tmp, model, "trainer_steps_ratio_mini_batches2_vs_1", tis,
                                      {**tis, "mini_batches": 2})}


def exports(trainer: GRPOTrainer | TrainerGroup) -> float:
    """Seconds of one whole weight sync's read (blocking)."""
    return timed(lambda: read_all(trainer.live_weights()))


def in_process(tmp: Path, model: Path, repeats: int) -> tuple[int, list[float], list[float]]:
    """World size 1: parameters, export and capture seconds (the trainer is freed on return)."""
    one_config = config(tmp, model, 1)
    one = GRPOTrainer(one_config, build_policy(one_config.model, 0))
    return (sum(p.numel() for p in one.model.parameters()), [exports(one) for _ in range(repeats)],
            [timed(one.capture_state) for _ in range(repeats)])


def in_process_bf16(tmp: Path, model: Path, repeats: int) -> list[float]:
    """World size 1, bf16 over fp32 masters: export seconds."""
    one_config = config(tmp, model, 1, "bfloat16")
    one = GRPOTrainer(one_config, build_policy(one_config.model, 0))
    return [exports(one) for _ in range(repeats)]


def ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


async def at_100m(tmp: Path, model: Path, repeats: int = 3) -> dict[str, float]:
    params, export_1, capture_1 = await anyio.to_thread.run_sync(in_process, tmp, model, repeats)
    export_2, submit_2, capture_2, write_2 = [], [], [], []
    async with TrainerGroup.open(config(tmp, model, 2)) as two:
        for k in range(repeats):
            export_2.append(await anyio.to_thread.run_sync(exports, two))
            started = time.perf_counter()
            capture = two.capture_state()
            submit_2.append(time.perf_counter() - started)
            await anyio.to_thread.run_sync(capture.wait_captured)
            capture_2.append(time.perf_counter() - started)
            await anyio.to_thread.run_sync(capture.write, tmp / f"model-{k}.pt", tmp / f"optimizer-{k}.pt")
            write_2.append(time.perf_counter() - started)
    return {"model_parameters_100m": float(params),
            "weight_export_ms_100m_world1": ms(export_1), "weight_export_ms_100m_world2": ms(export_2),
            "weight_export_world2_vs_world1_ratio_100m": ms(export_2) / ms(export_1),
            "trainer_state_capture_ms_100m": ms(capture_2), "trainer_state_capture_submit_ms_100m": ms(submit_2),
            "trainer_state_write_ms_100m": ms(write_2),
            "trainer_state_capture_ms_100m_world1": ms(capture_1)}


async def exports_100m_bf16(tmp: Path, model: Path, repeats: int = 3) -> dict[str, float]:
    export_1 = await anyio.to_thread.run_sync(in_process_bf16, tmp, model, repeats)
    async with TrainerGroup.open(config(tmp, model, 2, "bfloat16")) as two:
        export_2 = [await anyio.to_thread.run_sync(exports, two) for _ in range(repeats)]
    return {"weight_export_ms_100m_world1_bf16": ms(export_1), "weight_export_ms_100m_world2_bf16": ms(export_2),
            "weight_export_world2_vs_world1_ratio_100m_bf16": ms(export_2) / ms(export_1)}


async def figures(tmp: Path) -> dict[str, float]:
    """Every figure above (Ray must be up with 4 free logical CPUs)."""
    small = init_tiny(tmp / "tiny-llama")
    large = write_tied_llama(tmp / "llama-100m", vocab_size=32_000, hidden_size=768, layers=12, heads=12)
    return {**await steps_ratio(tmp, small), **await anyio.to_thread.run_sync(correction_costs, tmp, small),
            **await at_100m(tmp, large), **await exports_100m_bf16(tmp, large)}


async def main() -> None:
    import ray

    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.2", logging_level=logging.WARNING)
    try:
        with TemporaryDirectory(dir=REPO / "bench") as tmp:
            summary = await figures(Path(tmp))
    finally:
        ray.shutdown()
    merge_and_print(summary, GOALS)


if __name__ == "__main__":
    anyio.run(main)
