"""`make bench`: what checkpointing costs, measured in one run, written to bench/results/.

Benchmarks, not tests: they report numbers and never fail on them.  Ratios
are taken within one run because absolute times drift on a shared 2-core box.
"""

from __future__ import annotations

import itertools
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import anyio
import orjson
import torch

from bench import engines, evaluation, goodput, rewards, trainer_group, trainer_memory, trainer_state
from bench.commits import ZERO_SCORES, checkpoint_now, clear, fake_group, fill
from bench.configs import REPO, tiny
from bench.recovery import crash_recovery, prefix_recovery, staging_cost
from bench.summary import bench_module, percentile, probe_loop, work_tree, write
from scd.checkpoint import layout
from scd.checkpoint.save import capture_cut
from scd.config import Config
from scd.daemon import Controller
from scd.model.policy import build_policy
from scd.model.prompts import render_task
from scd.rewards import load_rewards
from scd.training.grpo import GRPOTrainer
from scd.triggers import Triggers

RESULTS = REPO / "bench" / "results"
GOALS = {
    "checkpoint_overhead_ratio": ("in", (0.98, 1.02)), "snapshot_bytes_ratio": ("<=", 1.1),
    "sidecar_vs_legacy_ratio": ("<=", 0.01), "exclusive_hold_ms_10k": ("<=", 20.0),
    "checkpoint_vs_disk_ratio": ("<=", 2.0), "restore_overhead_ratio": ("<=", 1.05),
    "generation_tokens_ratio_in_checkpoint_windows": (">=", 0.98), "max_mutation_wait_ms_10k": ("<=", 50.0),
    "train_pump_blocked_ms_10k": ("<=", 50.0),
    "commit_path_groups_per_s": (">=", 20000.0), "loop_stall_p99_ms": ("<=", 50.0),
    **{f"crash_{s}_{k}": (">=", 1.0) for s in ("windowed", "weight_fifo", "in_order")
       for k in ("ready_groups_kept_ratio", "siblings_reused_ratio", "siblings_reused_vs_finished_at_cut")},
    **{f"crash_{s}_tokens_reused_vs_generated_at_cut": (">=", 0.99) for s in ("windowed", "weight_fifo", "in_order")},
    **goodput.GOALS, **engines.GOALS,
    "trackers_overhead_ratio": (">=", 0.98), "trackers_loop_stall_p99_ms": ("<=", 50.0),
    **rewards.GOALS, **trainer_memory.GOALS, **evaluation.GOALS, **trainer_state.GOALS, **trainer_group.GOALS,
}


async def timed_run(config: Config, steps: int, probe: bool = False) -> dict[str, float]:
    """Committed groups/s (and loop stall) over ``steps`` trainer steps after a 10-step warm-up."""
    await clear(config.data_plane.partition)
    async with Controller.open(config) as controller:
        await controller.run(max_steps=10)
        stalls: list[float] = []


        groups0, tokens0 = controller.state.committed_groups, controller.tokens.statistics().generated_tokens
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            if probe:
                tg.start_soon(probe_loop, stalls)
            await controller.run(max_steps=10 + steps)
            tg.cancel_scope.cancel()
        elapsed = time.monotonic() - started
        out = {
            "steps_per_s": steps / elapsed,
            "committed_groups_per_s": (controller.state.committed_groups - groups0) / elapsed,
            "generated_tokens_per_s": (controller.tokens.statistics().generated_tokens - tokens0) / elapsed,
        }
        if probe:
            out |= {"loop_stall_p50_ms": 1000 * statistics.median(stalls),
                    "loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
                    "loop_stall_max_ms": 1000 * max(stalls)}
        if controller.checkpointer is not None:
            out["checkpoints_completed"] = controller.checkpointer.statistics().completed
        return out


async def overhead(tmp: Path, steps: int = 150, pairs: int = 4) -> dict[str, float]:
    """The same seeded run with checkpoints every 5 s and with checkpointing off, in interleaved pairs.

    Off and on alternate (off, on, off, on, ...), so drift of the box hits both alike. Throughput is
    trainer steps/s (what a run is for; committed groups/s also counts groups later evicted as stale,
    which varies with timing).  The ratio is the median of the pairs' ratios; the spread is max - min.
    """
    ratios, offs, ons, checkpoints = [], [], [], []
    first_off: dict[str, float] = {}
    for pair in range(pairs):
        off = await timed_run(tiny(tmp / f"off{pair}"), steps, probe=pair == 0)
        on = await timed_run(tiny(tmp / f"on{pair}", checkpointing={"enabled": True, "interval_s": 5.0}), steps)
        first_off = first_off or off
        ratios.append(on["steps_per_s"] / off["steps_per_s"])
        offs.append(off)
        ons.append(on)
        checkpoints.append(on["checkpoints_completed"])
    return {
        "checkpoint_overhead_ratio": statistics.median(ratios),
        "checkpoint_overhead_ratio_spread": max(ratios) - min(ratios),
        "checkpoint_overhead_pairs": len(ratios),
        "steps_per_s_off": statistics.median(r["steps_per_s"] for r in offs),
        "steps_per_s_on": statistics.median(r["steps_per_s"] for r in ons),
        "committed_groups_per_s_off": statistics.median(r["committed_groups_per_s"] for r in offs),
        "committed_groups_per_s_on": statistics.median(r["committed_groups_per_s"] for r in ons),
        "checkpoints_during_run": statistics.median(checkpoints),
        "steps_per_s": first_off["steps_per_s"], "generated_tokens_per_s": first_off["generated_tokens_per_s"],
        "loop_stall_p50_ms": first_off["loop_stall_p50_ms"], "loop_stall_p99_ms": first_off["loop_stall_p99_ms"],
        "loop_stall_max_ms": first_off["loop_stall_max_ms"],
    }


@dataclass(frozen=True)
class StepRate:
    steps_per_s: float
    loop_stall_p99_ms: float


async def step_rate(config: Config, steps: int, warmup: int) -> StepRate:
    """Trainer steps/s over ``steps`` steps after ``warmup`` (the event log's step times), and the loop
    stall p99, from one uninterrupted run."""
    await clear(config.data_plane.partition)
    stalls: list[float] = []


    async with Controller.open(config) as controller, anyio.create_task_group() as tg:
        tg.start_soon(probe_loop, stalls)
        await controller.run(max_steps=warmup + steps)
        tg.cancel_scope.cancel()
    at = {e["step"]: e["time"] for e in map(orjson.loads, Path(config.telemetry.events_path).read_bytes().splitlines())
          if e["event"] == "train_step"}
    return StepRate(steps / (at[warmup + steps] - at[warmup]), 1000 * percentile(stalls, 0.99))


async def trackers_overhead(tmp: Path, steps: int = 150, pairs: int = 10) -> dict[str, float]:
    """Trainer steps/s with TensorBoard, W&B (offline) and MLflow (a file store) all on, over all off.

    The same seeded run each, in pairs ordered off-on, on-off, off-on, ... so that a drift of the box over
    the benchmark falls on both sides alike; the ratio is the median of the pairs' ratios, reported with
    its spread (max - min) and quartiles.  Both sides probe the loop, so the probe costs each alike; the
    stall p99 is the trackers-on runs' median.  The trackers' processes start with the controller: the
    warm-up's 30 steps cover their start (imports, W&B's service), so the figure is the steady state.
    """
    on = {"telemetry": {"trackers": ["tensorboard", "wandb", "mlflow"], "wandb": {"mode": "offline"}}}
    offs, ons = [], []
    for pair in range(pairs):
        for side in (("off", "on") if pair % 2 == 0 else ("on", "off")):
            config = tiny(tmp / f"trackers-{side}{pair}", **(on if side == "on" else {}))
            (ons if side == "on" else offs).append(await step_rate(config, steps, warmup=30))
    ratios = sorted(on_run.steps_per_s / off_run.steps_per_s for off_run, on_run in zip(offs, ons, strict=True))
    print(f"trackers_overhead pair ratios: {' '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    return {
        "trackers_overhead_ratio": statistics.median(ratios),
        "trackers_overhead_ratio_spread": ratios[-1] - ratios[0],
        "trackers_overhead_ratio_q1": percentile(ratios, 0.25),
        "trackers_overhead_ratio_q3": percentile(ratios, 0.75),
        "trackers_overhead_pairs": pairs,
        "trackers_steps_per_s_on": statistics.median(r.steps_per_s for r in ons),
        "trackers_steps_per_s_off": statistics.median(r.steps_per_s for r in offs),
        "trackers_loop_stall_p99_ms": statistics.median(r.loop_stall_p99_ms for r in ons),
        "trackers_off_loop_stall_p99_ms": statistics.median(r.loop_stall_p99_ms for r in offs),
    }


def disk_write_bandwidth(directory: Path, size: int = 256 << 20) -> float:
    """Sequential write bandwidth with fsync, bytes/s, on the disk under ``directory``."""
    path = directory / "bandwidth.bin"
    block = os.urandom(1 << 20)
    started = time.monotonic()
    with path.open("wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.monotonic() - started
    path.unlink()
    return size / elapsed


async def snapshot_and_restore(tmp: Path, groups: int = 10_000, tokens: int = 109) -> dict[str, float]:
    """At 80k rows (10k groups of 8): snapshot size, sidecar vs legacy, checkpoint vs disk bandwidth
    (median of 3 of each, interleaved), restore vs a bare ``tq.load_checkpoint``."""
    import transfer_queue as tq
    from tensordict import TensorDict

    group_size = 8
    rows = groups * group_size
    config = tiny(tmp / "snap", generation={"group_size": group_size},
                  # Its groups (made at version 0) stay within the window of the bundles' versions 1 to 3.
                  async_rl={"buffer_capacity_groups": groups + 64, "sampler": {"max_staleness_versions": 4}},
                  task={"size": groups + 64}, data_plane={"call_timeout_s": 600.0},
                  checkpointing={"enabled": True, "keep_last": 4})
    await clear("bench")
    checkpoint_s, bandwidths = [], []
    async with Controller.open(config) as controller:
        payload = await fill(controller, groups, tokens)
        assert controller.checkpointer is not None
        for attempt in range(3):
            # A bundle's step and weight version move together (verify refuses one that says otherwise).
            controller.state.trainer_step = controller.state.weight_version = attempt + 1
            started = time.monotonic()
            await checkpoint_now(controller)
            checkpoint_s.append(time.monotonic() - started)
            bandwidths.append(disk_write_bandwidth(tmp))
        bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
        legacy = tmp / "replay_buffer.pt"
        keys = sorted(controller.state.replay.keys())
        data = [row for rows in await controller.dataplane.get_groups(keys) for row in rows]
        torch.save({"sample_ids": sorted(controller.state.replay.sample_ids()), "input_ids": [r[0] for r in data],
                    "logprobs": [r[1] for r in data]}, legacy)
    snapshot_bytes = layout.dir_bytes(bundle / layout.DATA_PLANE_DIR)
    bundle_bytes = layout.dir_bytes(bundle)
    sidecar_bytes = (bundle / layout.SIDECAR_FILE).stat().st_size
    bandwidth = statistics.median(bandwidths)

    loads, restores, reports = [], [], []
    for _ in range(3):
        await clear("bench")
        started = time.monotonic()
        tq.load_checkpoint(bundle / layout.DATA_PLANE_DIR)
        loads.append(time.monotonic() - started)
        await clear("bench")
        async with Controller.open(config) as controller:
            report = await controller.restore(bundle)
            assert report is not None
        restores.append(report.phases["total"])
        reports.append(report)
    load_s, restore_s = statistics.median(loads), statistics.median(restores)
    report = reports[restores.index(restore_s)]

    # TQ used naively: one dense [8, tokens] tensor per put, as the docs suggest.
    await clear("bench")
    naive_dir = tmp / "naive"
    for g in range(groups // 8):
        fields = TensorDict({"input_ids": torch.randint(0, 50, (group_size, tokens)),
                             "logprobs": torch.rand(group_size, tokens - 8)}, batch_size=[group_size])
        await tq.async_kv_batch_put(keys=[f"n{g}/{s}" for s in range(group_size)], partition_id="bench-naive",
                                    fields=fields)
    tq.save_checkpoint(naive_dir)
    naive_bytes = layout.dir_bytes(naive_dir)
    # Its keys are no scd keys (a DataPlane's clear would take them for staged siblings of another partition):
    # left behind, they made the next module's restore refuse a TQ holding partitions not its own.
    await tq.async_kv_clear([f"n{g}/{s}" for g in range(groups // 8) for s in range(group_size)], "bench-naive")
    return {
        "snapshot_rows": rows,
        "snapshot_bytes_ratio": snapshot_bytes / payload,
        # An eighth of the groups, as dense batches: its ratio is per payload byte either way.
        "snapshot_bytes_ratio_naive_batch8": naive_bytes / (payload / 8),
        "payload_bytes_80k_rows": payload, "snapshot_bytes_80k_rows": snapshot_bytes,
        "bundle_bytes_80k_rows": bundle_bytes,
        "sidecar_vs_legacy_ratio": sidecar_bytes / legacy.stat().st_size,
        "sidecar_bytes_80k_rows": sidecar_bytes, "legacy_replay_bytes_80k_rows": legacy.stat().st_size,
        "checkpoint_seconds_80k_rows": statistics.median(checkpoint_s),
        "disk_write_bytes_per_s": bandwidth,
        # The whole bundle is written and fsynced, so its bytes are what the disk must take.
        "checkpoint_vs_disk_ratio": statistics.median(checkpoint_s) / (bundle_bytes / bandwidth),
        "restore_seconds_80k_rows": restore_s, "tq_load_checkpoint_seconds_80k_rows": load_s,
        "restore_overhead_ratio": restore_s / load_s,
        # resolve includes the BLAKE3 digest of every bundle file, checked before TQ unpickles them.
        **{f"restore_{phase}_seconds_80k_rows": seconds for phase, seconds in report.phases.items()
           if phase != "total"},
    }


async def exclusive_hold(tmp: Path, groups: int = 1_000) -> dict[str, float]:
    """The exclusive hold (the cut alone: TQ saves outside it) with 1k ready groups of small rows."""
    config = tiny(tmp / f"hold{groups}", async_rl={"buffer_capacity_groups": groups + 64},
                  checkpointing={"enabled": True, "keep_last": 2})
    await clear("bench")
    async with Controller.open(config) as controller:
        await fill(controller, groups, tokens=24)
        holds = []
        for _ in range(5):
            phases: dict[str, float] = {}
            await capture_cut(controller.state, controller.dataplane, phases)
            await controller.dataplane.close_save_window()
            holds.append(phases["exclusive_hold"])
    await clear("bench")
    return {"exclusive_hold_ms_1k": 1000 * statistics.median(holds)}


async def live_checkpoints(tmp: Path, groups: int = 10_000, seconds: float = 75.0) -> dict[str, float]:
    """Checkpoints of a running daemon with ``groups`` ready groups (80k rows, ~1.3 KB each) buffered.

    The synthetic backend stands in for a GPU engine at a fixed token rate; the question is
    whether a checkpoint ever leaves it without work, holds a mutation, or stalls the train pump.
    A probe samples the engine's token counter and whether a checkpoint is in progress every 20 ms.
    """
    config = tiny(
        tmp / "live", model={"max_len": 128},
        generation={"backend": "synthetic", "max_inflight_prompts": 32, "commit_queue_groups": 4096,
                    "max_new_tokens": 110,
                    "synthetic": {"tokens_per_s": 20_000.0, "min_completion_tokens": 90,
                                  "max_completion_tokens": 110, "batch_groups": 4}},
        async_rl={"buffer_capacity_groups": groups + 4_000,
                  "sampler": {"name": "windowed", "max_staleness_versions": 1_000_000}},
        task={"size": 1_000_000}, data_plane={"call_timeout_s": 600.0},
        checkpointing={"enabled": True, "interval_s": 3600.0, "keep_last": 2})
    await clear("bench")
    async with Controller.open(config) as controller:
        await fill(controller, groups, tokens=109)
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()
        samples: list[tuple[float, int, bool]] = []

        async def probe() -> None:
            while True:
                samples.append((time.monotonic(), controller.tokens.statistics().generated_tokens,
                                checkpointer.statistics().writing))
                await anyio.sleep(0.02)

        async def request_checkpoints() -> None:
            await anyio.sleep(5.0)
            while True:
                triggers.request_checkpoint()
                await anyio.sleep(1.0)
                while checkpointer.statistics().writing:
                    await anyio.sleep(0.05)
                await anyio.sleep(4.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            tg.start_soon(request_checkpoints)
            with anyio.move_on_after(seconds):
                await controller.run(triggers, max_steps=1_000_000)
            tg.cancel_scope.cancel()
        barrier = controller.state.barrier.statistics()
    await clear("bench")

    inside = [0.0, 0.0]  # tokens, seconds
    outside = [0.0, 0.0]
    for (t0, tokens0, writing), (t1, tokens1, _) in itertools.pairwise(samples):
        bucket = inside if writing else outside
        bucket[0] += tokens1 - tokens0
        bucket[1] += t1 - t0
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
    done = [e["phases"] for e in events if e["event"] == "checkpoint" and e["outcome"] == "completed"]
    steps = [e for e in events if e["event"] == "train_step"]
    windows = [(e["time"] - e["phases"]["total"], e["time"]) for e in events
               if e["event"] == "checkpoint" and e["outcome"] == "completed"]
    # A step's event comes after its read and its training: a read up to one step after the window
    # may have waited on the save.  Blocked per checkpoint: the wait for the cut, plus how much the
    # slowest read of its window exceeded a typical read.
    outside_reads = [e["tq_read_ms"] for e in steps if not any(a <= e["time"] <= b + 1.0 for a, b in windows)]
    typical_read = statistics.median(outside_reads) if outside_reads else 0.0
    blocked = []
    in_window: list[float] = []
    for (a, b), phases in zip(windows, done, strict=True):
        window_reads = [e["tq_read_ms"] for e in steps if a <= e["time"] <= b + 1.0]
        in_window += window_reads
        blocked.append(1000 * phases["train_pump_blocked"] + max(0.0, max(window_reads, default=0.0) - typical_read))
    return {
        "live_checkpoints_10k": len(done),
        "generation_tokens_ratio_in_checkpoint_windows": (inside[0] / inside[1]) / (outside[0] / outside[1]),
        "generation_tokens_per_s_outside_checkpoints": outside[0] / outside[1],
        "checkpoint_window_seconds_10k": inside[1] / max(1, len(done)),
        "exclusive_hold_ms_10k": 1000 * statistics.median(p["exclusive_hold"] for p in done),
        "max_mutation_wait_ms_10k": 1000 * max(barrier.max_wait_seconds.values(), default=0.0),
        "train_pump_blocked_ms_10k": statistics.median(blocked),
        "train_pump_cut_wait_ms_10k": 1000 * statistics.median(p["train_pump_blocked"] for p in done),
        "state_copy_ms_10k": 1000 * statistics.median(p["state_copy"] for p in done),
        "tq_save_ms_10k": 1000 * statistics.median(p["tq_save"] for p in done),
        "tq_list_ms_10k": 1000 * statistics.median(p["tq_list"] for p in done),
        "checkpoint_total_ms_10k": 1000 * statistics.median(p["total"] for p in done),
        # The train pump's reads queue behind TQ's save on the storage unit (one worker thread per unit).
        "train_read_ms_p50_outside_checkpoints": typical_read,
        "train_read_ms_max_in_checkpoint_windows": max(in_window, default=0.0),
        "train_steps_live_10k": len(steps),
    }


class _NoDataPlane:
    """The commit path without TQ: a data plane whose calls return at once."""

    partition = "none"
    data_ops = 0

    async def put_group(self, key: str, rows: Any) -> None:
        return None

    async def put_siblings(self, keys: Any, completions: Any) -> None:
        return None

    async def clear(self, keys: Any) -> None:
        return None

    def clear_later(self, keys: Any) -> None:
        return None

    async def discard_failed_put(self, keys: Any) -> None:
        return None


async def commit_path(tmp: Path, groups: int = 20_000) -> dict[str, float]:
    """Admit + commit + consume through barrier, index and ledger, with TQ taken out."""
    config = tiny(tmp / "commit", async_rl={"buffer_capacity_groups": groups + 64}, task={"size": groups})
    policy = build_policy(config.model, config.run.seed)
    controller = Controller(config, _NoDataPlane(), None, policy, render_task(config, policy).prompts,  # type: ignore[arg-type]
                            GRPOTrainer(config, policy), load_rewards(config.task, tmp), [])
    started = time.monotonic()
    for _ in range(groups):
        request = await controller.rollouts.admit()
        await controller.rollouts.commit(fake_group(request, len(request.prompt_ids) + 4), ZERO_SCORES)
    committed = time.monotonic() - started
    started = time.monotonic()
    batch = controller.state.replay.groups()
    for i in range(0, len(batch), 16):
        await controller.state.finish_step(batch[i:i + 16])
    consumed = time.monotonic() - started
    return {"commit_path_groups_per_s": groups / committed, "consume_path_groups_per_s": groups / consumed}


def cluster_figures() -> dict[str, float]:
    """bench/cluster.py in its own process: a driver joins one Ray cluster, and this one ran its own."""
    with TemporaryDirectory() as tmp:
        out = Path(tmp) / "cluster.json"
        subprocess.run([sys.executable, "-m", "bench.cluster", str(out)], cwd=REPO, check=True, timeout=1800)
        return orjson.loads(out.read_bytes())


async def main(only: frozenset[str] = frozenset()) -> None:
    """Every benchmark, written to bench/results/summary.json; with ``only`` (names on the command line,
    ``python -m bench.run trackers_overhead``), just those, their keys merged into the summary there."""
    import ray
    import transfer_queue as tq

    RESULTS.mkdir(parents=True, exist_ok=True)
    tree = work_tree()
    # 3 for TQ's controller and storage unit (and a spare), 2 for the trainer group's ranks.
    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.2",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    measured: dict[str, dict[str, float]] = {}
    known = {"cluster"}
    try:
        with TemporaryDirectory(dir=REPO / "bench") as tmp_name:
            tmp = Path(tmp_name)
            for name, bench in (("commit_path", commit_path), ("overhead", overhead),
                                ("exclusive_hold", exclusive_hold), ("live_checkpoints", live_checkpoints),
                                ("snapshot", snapshot_and_restore),
                                ("crash_recovery", crash_recovery), ("prefix_recovery", prefix_recovery),
                                ("staging_cost", staging_cost), ("goodput_regimes", goodput.regimes),
                                ("goodput_crash_loop", goodput.crash_loops),
                                ("vllm_cpu", engines.vllm_cpu), ("weight_sync", engines.weight_sync),
                                ("trackers_overhead", trackers_overhead), ("trainer_group", trainer_group.figures),
                                ("reward_loop_stall", rewards.loop_stall), ("reward_stage", rewards.stage),
                                ("trainer_memory", trainer_memory.figures),
                                ("trainer_state", trainer_state.figures),
                                ("eval_overhead", evaluation.eval_overhead),
                                ("export_seconds", evaluation.export_seconds)):
                known.add(name)
                if only and name not in only:
                    continue
                started = time.monotonic()
                measured.setdefault(bench_module(bench), {}).update(await bench(tmp))
                # Merged as each finishes: a module that fails later (an hour in) loses none measured before it.
                write(measured, tree)
                print(f"[{name}: {time.monotonic() - started:.0f}s]", flush=True)
    finally:
        tq.close()
        ray.shutdown()
    if only - known:
        raise SystemExit(f"bench.run: no benchmark named {sorted(only - known)}; known: {sorted(known)}")
    if not only or "cluster" in only:
        started = time.monotonic()
        measured["bench.cluster"] = cluster_figures()
        print(f"[cluster: {time.monotonic() - started:.0f}s]", flush=True)
    meta = {"time": time.time(), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__}
    # A partial run adds its keys to the last full run's; the meta stays that run's.
    write(measured, tree, meta=None if only else meta)
    summary = {key: value for figures in measured.values() for key, value in figures.items()}
    print(f"{'metric':36s} {'value':>14s}  goal")
    for key, value in summary.items():
        goal = GOALS.get(key)
        mark = ""
        if goal:
            op, bound = goal
            if isinstance(bound, tuple):
                ok, shown = bound[0] <= value <= bound[1], f"{bound[0]:g}-{bound[1]:g}"
            else:
                ok, shown = (value >= bound if op == ">=" else value <= bound), f"{bound:g}"
            mark = f"{op} {shown}  {'met' if ok else 'MISSED'}"
        print(f"{key:36s} {value:14.4f}  {mark}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, frozenset(sys.argv[1:]), backend="asyncio", backend_options={"use_uvloop": True})
