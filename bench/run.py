"""`make bench`: what checkpointing costs, measured in one run, written to bench/results/.

Benchmarks, not tests: they report numbers and never fail on them.  Ratios
are taken within one run because absolute times drift on a shared 2-core box.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import anyio
import orjson
import torch

from bench.gpu_check import summarize_steps
from scd.checkpoint import layout
from scd.checkpoint.restore import restore_state
from scd.checkpoint.save import capture_cut
from scd.config import Config, derive_config
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.generation.base import GroupResult
from scd.records import Completion, FinishReason
from scd.schema import Trigger
from scd.tasks import build_task
from scd.training.policy import build_policy

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GOALS = {
    "checkpoint_overhead_ratio": (">=", 0.99), "snapshot_bytes_ratio": ("<=", 1.1),
    "sidecar_vs_legacy_ratio": ("<=", 0.01), "exclusive_hold_ms_10k": ("<=", 20.0),
    "checkpoint_vs_disk_ratio": ("<=", 2.0), "restore_overhead_ratio": ("<=", 1.10),
    "commit_path_groups_per_s": (">=", 20000.0), "loop_stall_p99_ms": ("<=", 50.0),
}


def tiny(tmp: Path, partition: str = "bench", **overrides: dict[str, object]) -> Config:
    base: dict[str, dict[str, object]] = {"run": {"output_dir": str(tmp)}, "telemetry": {"metrics_port": 0},
                                          "data_plane": {"partition": partition}}
    return derive_config(REPO / "configs" / "tiny.toml", base, overrides)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def clear(partition: str) -> None:
    await DataPlane(tiny(Path("/tmp"), partition).data_plane).clear_all()


async def timed_run(config: Config, steps: int, probe: bool = False) -> dict[str, float]:
    """Committed groups/s (and loop stall) over ``steps`` trainer steps after a 10-step warm-up."""
    await clear(config.data_plane.partition)
    async with Controller.open(config) as controller:
        await controller.run(max_steps=10)
        stalls: list[float] = []

        async def loop_probe() -> None:
            while True:
                before = time.monotonic()
                await anyio.sleep(0.01)
                stalls.append(time.monotonic() - before - 0.01)

        groups0, tokens0 = controller.state.committed_groups, controller.backend.generated_tokens()
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            if probe:
                tg.start_soon(loop_probe)
            await controller.run(max_steps=10 + steps)
            tg.cancel_scope.cancel()
        elapsed = time.monotonic() - started
        out = {
            "steps_per_s": steps / elapsed,
            "committed_groups_per_s": (controller.state.committed_groups - groups0) / elapsed,
            "generated_tokens_per_s": (controller.backend.generated_tokens() - tokens0) / elapsed,
        }
        if probe:
            out |= {"loop_stall_p50_ms": 1000 * statistics.median(stalls),
                    "loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
                    "loop_stall_max_ms": 1000 * max(stalls)}
        if controller.checkpointer is not None:
            out["checkpoints_completed"] = controller.checkpointer.statistics().completed
        return out


async def overhead(tmp: Path, steps: int = 150) -> dict[str, float]:
    """The same seeded run with checkpoints every 10 s and with checkpointing off."""
    off = await timed_run(tiny(tmp / "off"), steps, probe=True)
    on = await timed_run(tiny(tmp / "on", checkpointing={"enabled": True, "interval_s": 10.0}), steps)
    return {
        "checkpoint_overhead_ratio": on["committed_groups_per_s"] / off["committed_groups_per_s"],
        "committed_groups_per_s_off": off["committed_groups_per_s"],
        "committed_groups_per_s_on": on["committed_groups_per_s"],
        "checkpoints_during_run": on["checkpoints_completed"],
        "steps_per_s": off["steps_per_s"], "generated_tokens_per_s": off["generated_tokens_per_s"],
        "loop_stall_p50_ms": off["loop_stall_p50_ms"], "loop_stall_p99_ms": off["loop_stall_p99_ms"],
        "loop_stall_max_ms": off["loop_stall_max_ms"],
    }


@functools.cache
def _completions(group_size: int, length: int) -> list[Completion]:
    return [Completion(torch.randint(4, 50, (length,)).tolist(), torch.rand(length).tolist(), FinishReason.LENGTH, 0)
            for _ in range(group_size)]


def fake_group(request: Any, tokens: int) -> GroupResult:
    """A group of ``tokens``-long rows (prompt included), as a backend would return it."""
    completions = _completions(request.group_size, tokens - len(request.prompt_ids))
    return GroupResult(request, completions, end_weight_version=0)


async def fill(controller: Controller, groups: int, tokens: int) -> int:
    """Commit ``groups`` groups through the controller's real commit path; returns payload bytes."""
    payload = 0
    for _ in range(groups):
        result = fake_group(await controller.admit(), tokens)
        # int64 input_ids and float32 logprobs per row, as they land in TQ.
        payload += sum(8 * (len(result.request.prompt_ids) + len(c.token_ids)) + 4 * len(c.token_ids)
                       for c in result.completions)
        await controller.commit(result)
    return payload


async def checkpoint_now(controller: Controller) -> None:
    """One checkpoint at the current step, written before this returns (the writer runs only for it)."""
    assert controller.checkpointer is not None
    async with anyio.create_task_group() as tg:
        await tg.start(controller.checkpointer.run_writer)
        await controller.checkpointer.attempt(Trigger.SIGNAL, wait=True)
        tg.cancel_scope.cancel()


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


async def snapshot_and_restore(tmp: Path, rows: int = 10_000, tokens: int = 1024) -> dict[str, float]:
    """Snapshot size, sidecar vs legacy, checkpoint vs disk, restore vs tq.load_checkpoint, at 10k rows."""
    import transfer_queue as tq
    from tensordict import TensorDict

    group_size = 8
    config = tiny(tmp / "snap", generation={"group_size": group_size},
                  async_rl={"buffer_capacity_groups": rows // group_size + 64},
                  checkpointing={"enabled": True, "keep_last": 2})
    await clear("bench")
    async with Controller.open(config) as controller:
        payload = await fill(controller, rows // group_size, tokens)
        assert controller.checkpointer is not None
        started = time.monotonic()
        await checkpoint_now(controller)
        checkpoint_s = time.monotonic() - started
        bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
        legacy = tmp / "replay_buffer.pt"
        ids = sorted(controller.state.replay.sample_ids())
        data = await controller.dataplane.get_rows(ids)
        torch.save({"sample_ids": ids, "input_ids": list(data["input_ids"].unbind()),
                    "logprobs": list(data["logprobs"].unbind())}, legacy)
    snapshot_bytes = layout.dir_bytes(bundle / layout.DATA_PLANE_DIR)
    sidecar_bytes = (bundle / layout.SIDECAR_FILE).stat().st_size
    bandwidth = disk_write_bandwidth(tmp)

    await clear("bench")
    started = time.monotonic()
    tq.load_checkpoint(bundle / layout.DATA_PLANE_DIR)
    load_s = time.monotonic() - started
    await clear("bench")
    async with Controller.open(config) as controller:
        report = await restore_state(config, controller.state, controller.dataplane, controller.trainer, bundle,
                                     allow_config_change=False)
        assert report is not None
    restore_s = report.phases["total"]

    # TQ used naively: one dense [8, 1024] tensor per put, as the docs suggest.
    await clear("bench")
    naive_dir = tmp / "naive"
    for g in range(rows // group_size):
        fields = TensorDict({"input_ids": torch.randint(0, 50, (group_size, tokens)),
                             "logprobs": torch.rand(group_size, tokens - 8)}, batch_size=[group_size])
        await tq.async_kv_batch_put(keys=[f"n{g}/{s}" for s in range(group_size)], partition_id="bench-naive",
                                    fields=fields)
    tq.save_checkpoint(naive_dir)
    naive_bytes = layout.dir_bytes(naive_dir)
    await clear("bench-naive")
    return {
        "snapshot_bytes_ratio": snapshot_bytes / payload,
        "snapshot_bytes_ratio_naive_batch8": naive_bytes / payload,
        "payload_bytes_10k": payload, "snapshot_bytes_10k": snapshot_bytes,
        "sidecar_vs_legacy_ratio": sidecar_bytes / legacy.stat().st_size,
        "sidecar_bytes_10k": sidecar_bytes, "legacy_replay_bytes_10k": legacy.stat().st_size,
        "checkpoint_seconds_10k_rows": checkpoint_s,
        "disk_write_bytes_per_s": bandwidth,
        "checkpoint_vs_disk_ratio": checkpoint_s / (snapshot_bytes / bandwidth),
        "restore_seconds_10k_rows": restore_s, "tq_load_checkpoint_seconds_10k_rows": load_s,
        "restore_overhead_ratio": restore_s / load_s,
        # resolve includes the SHA-256 of every bundle file, checked before TQ unpickles them.
        **{f"restore_{phase}_seconds_10k_rows": seconds for phase, seconds in report.phases.items()
           if phase != "total"},
    }


async def exclusive_hold(tmp: Path) -> dict[str, float]:
    """The exclusive hold (TQ's save inside it included) with 1k and 10k ready groups of small rows."""
    out: dict[str, float] = {}
    for groups in (1_000, 10_000):
        config = tiny(tmp / f"hold{groups}", async_rl={"buffer_capacity_groups": groups + 64},
                      checkpointing={"enabled": True, "keep_last": 2})
        await clear("bench")
        async with Controller.open(config) as controller:
            await fill(controller, groups, tokens=24)
            assert controller.checkpointer is not None
            holds, saves, lists = [], [], []
            for attempt in range(3):
                controller.state.trainer_step = attempt + 1
                phases: dict[str, float] = {}
                tmp_dir = tmp / f"hold{groups}-{attempt}"
                tmp_dir.mkdir(parents=True)
                await capture_cut(controller.state, controller.dataplane, tmp_dir, phases)
                holds.append(phases["exclusive_hold"])
                saves.append(phases["tq_save"])
                lists.append(phases["tq_list"])
        suffix = "10k" if groups == 10_000 else "1k"
        out[f"exclusive_hold_ms_{suffix}"] = 1000 * statistics.median(holds)
        out[f"tq_save_ms_{suffix}"] = 1000 * statistics.median(saves)
        out[f"tq_list_ms_{suffix}"] = 1000 * statistics.median(lists)
        out[f"exclusive_hold_without_tq_ms_{suffix}"] = 1000 * statistics.median(
            h - t - s for h, t, s in zip(holds, lists, saves, strict=True))
    await clear("bench")
    return out


class _NoDataPlane:
    """The commit path without TQ: a data plane whose calls return at once."""

    partition = "none"
    data_ops = 0

    async def put_rows(self, sample_ids: Any, rows: Any) -> None:
        return None

    async def clear(self, sample_ids: Any) -> None:
        return None


async def commit_path(tmp: Path, groups: int = 20_000) -> dict[str, float]:
    """Admit + commit + consume through barrier, index and ledger, with TQ taken out."""
    config = tiny(tmp / "commit", async_rl={"buffer_capacity_groups": groups + 64}, task={"size": groups})
    policy = build_policy(config.model, config.run.seed)
    controller = Controller(config, _NoDataPlane(), None, policy, build_task(config.task))  # type: ignore[arg-type]
    started = time.monotonic()
    for _ in range(groups):
        request = await controller.admit()
        await controller.commit(fake_group(request, len(request.prompt_ids) + 4))
    committed = time.monotonic() - started
    started = time.monotonic()
    batch = controller.state.replay.groups()
    for i in range(0, len(batch), 16):
        await controller.state.finish_step(batch[i:i + 16])
    consumed = time.monotonic() - started
    return {"commit_path_groups_per_s": groups / committed, "consume_path_groups_per_s": groups / consumed}


async def vllm_cpu(tmp: Path, steps: int = 60) -> dict[str, float]:
    """configs/vllm-cpu.toml in this process (vLLM's engine core is its own process): per-step medians."""
    from scd.training.init_tiny import init_tiny

    config = derive_config(REPO / "configs" / "vllm-cpu.toml", {
        "run": {"output_dir": str(tmp / "vllm")}, "model": {"name": str(init_tiny(tmp / "tiny-llama"))},
        "telemetry": {"metrics_port": 0}, "data_plane": {"partition": "bench-vllm"}})
    async with Controller.open(config) as controller:
        await controller.run(max_steps=steps)
    # The first steps include the engine's warm-up.
    measured = summarize_steps(tmp / "vllm" / "events.jsonl", after_step=5)
    return {f"vllm_cpu_{key}": value for key, value in measured.items() if value is not None}


async def main() -> None:
    import ray
    import transfer_queue as tq

    RESULTS.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    summary: dict[str, float] = {}
    try:
        with TemporaryDirectory(dir=REPO / "bench") as tmp_name:
            tmp = Path(tmp_name)
            for name, bench in (("commit_path", commit_path), ("overhead", overhead),
                                ("exclusive_hold", exclusive_hold), ("snapshot", snapshot_and_restore),
                                ("vllm_cpu", vllm_cpu)):
                started = time.monotonic()
                summary |= await bench(tmp)
                print(f"[{name}: {time.monotonic() - started:.0f}s]", flush=True)
    finally:
        tq.close()
        ray.shutdown()
    meta = {"time": time.time(), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__}
    (RESULTS / "summary.json").write_bytes(orjson.dumps({**summary, "meta": meta}, option=orjson.OPT_INDENT_2))
    print(f"{'metric':36s} {'value':>14s}  goal")
    for key, value in summary.items():
        goal = GOALS.get(key)
        mark = ""
        if goal:
            ok = value >= goal[1] if goal[0] == ">=" else value <= goal[1]
            mark = f"{goal[0]} {goal[1]:g}  {'met' if ok else 'MISSED'}"
        print(f"{key:36s} {value:14.4f}  {mark}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
