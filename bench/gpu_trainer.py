"""scd's trainer on one GPU, torch only: ``python bench/gpu_trainer.py --out DIR [--tiny]``.

For the Qwen2.5-0.5B and 1.5B shapes (random weights built on the device; only the config and scd's
character tokenizer are written to disk), scd's own ``GRPOTrainer`` at world size 1 with bf16 compute over
fp32 master weights, chunked logprobs and per-layer activation checkpointing, on groups of 8 rows of
256 prompt + 512 completion tokens:

* the largest ``groups_per_step`` that fits (doubling from 1 until out of memory or past 90% of it),
  and at it: median step time, processed tokens/s, MFU (6 · parameters · tokens ÷ 989 TFLOP/s, the H200's
  dense bf16 peak), peak memory;
* the share of each parameter kind's elements one step at lr 1e-6 moves (fp32 masters: all of them);
* trainer state capture (to host), write (``CopiedState.write`` + fsync) and restore
  (``load_state_files``) seconds, against a raw write + fsync of the same bytes to the same disk.

It needs torch and transformers, and scd's own light dependencies (msgspec, orjson, prometheus-client,
anyio; no vLLM, Ray or TransferQueue): ``../shared/probes/gpu-trainer/README.md`` says how to carry
them to a host that lacks them.  It finishes within 6 minutes: the 1.5B shape's optional parts are left
out past ``BUDGET_S``.  ``--tiny`` runs the same code on the CPU at a tiny shape in seconds (the test).
Results go to DIR/gpu_trainer.json, rewritten after every section.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the checkout

from scd.config import parse_config
from scd.model.init_tiny import VOCABULARY, write_tokenizer
from scd.model.policy import HFPolicy
from scd.records import Rollout
from scd.training.grpo import GRPOTrainer

STARTED = time.monotonic()
BUDGET_S = 300.0
PEAK_FLOPS = 989e12
MEMORY_FRACTION = 0.9
GROUP_SIZE, PROMPT, COMPLETION = 8, 256, 512
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


class OnDevicePolicy(HFPolicy):
    """scd's HF policy over a config-only directory: the model is built with random weights on the device."""

    def __init__(self, config: Any, device: torch.device) -> None:
        super().__init__(config)
        self._device = device

    def build_model(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        with torch.device(self._device):
            return AutoModelForCausalLM.from_config(config, dtype=self._dtype).train()


def trainer_for(directory: Path, device: torch.device, groups: int, lr: float) -> GRPOTrainer:
    config = parse_config({
        "run": {"output_dir": str(directory)}, "model": {"name": str(directory), "dtype": "bfloat16"},
        "generation": {"group_size": GROUP_SIZE},
        "trainer": {"device": str(device), "lr": lr, "groups_per_step": groups, "activation_checkpointing": True},
    }, directory)
    return GRPOTrainer(config, OnDevicePolicy(config.model, device))


def groups_of(count: int, vocab: int) -> list[list[Rollout]]:
    generator = torch.Generator().manual_seed(count)
    return [[Rollout(torch.randint(len(VOCABULARY), vocab, (PROMPT + COMPLETION,), generator=generator),
                     torch.full((COMPLETION,), -float(torch.log(torch.tensor(float(vocab))))), PROMPT,
                     reward=float(index % 2), weight_version=0) for index in range(GROUP_SIZE)]
            for _ in range(count)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def release_cached_memory() -> None:
    """The device memory of what the caller has dropped, back to the device: a trainer is freed when its
    last reference goes (it is in no reference cycle), and the collection is for anything else that is."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def largest_fit(directory: Path, device: torch.device, vocab: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
    """The most groups a step holds within ``MEMORY_FRACTION`` of the device, doubling from 1."""
    tried: list[dict[str, Any]] = []
    fits, groups = 0, 1
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    while groups <= limit:
        trainer = trainer_for(directory, device, groups, 1e-6)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            trainer.step(groups_of(groups, vocab), weight_version=0)
            synchronize(device)
            peak = peak_bytes(device)
            tried.append({"groups": groups, "peak_gib": peak / 2**30})
            if total is not None and peak > MEMORY_FRACTION * total:
                break
            fits = groups
        except torch.OutOfMemoryError:
            tried.append({"groups": groups, "out_of_memory": True})
            break
        finally:
            del trainer  # before the next size's trainer is built
            release_cached_memory()
        groups *= 2
    return fits, tried


def timed_steps(trainer: GRPOTrainer, groups: list[list[Rollout]], device: torch.device, count: int) -> list[float]:
    for _ in range(2):
        trainer.step(groups, weight_version=0)
    seconds = []
    for _ in range(count):
        synchronize(device)
        started = time.perf_counter()
        trainer.step(groups, weight_version=0)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def moved_shares(trainer: GRPOTrainer, groups: list[list[Rollout]]) -> dict[str, float]:
    """Of each parameter kind's elements, the share one step at the trainer's lr changes."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.step(groups, weight_version=0)
    moved: dict[str, list[int]] = {}
    for name, p in trainer.model.named_parameters():
        kind = "norm" if "norm" in name else "embed" if "embed" in name else "other"
        counts = moved.setdefault(kind, [0, 0])
        counts[0] += int((p.detach() != before[name]).sum())
        counts[1] += p.numel()
    return {kind: changed / total for kind, (changed, total) in moved.items()}


def state_paths(trainer: GRPOTrainer, disk: Path) -> dict[str, float]:
    """Capture, write (+ fsync) and restore seconds of the trainer's state, and a raw write of as many bytes."""
    started = time.perf_counter()
    captured = trainer.capture_state()
    capture_s = time.perf_counter() - started
    model, optimizer = disk / "model.pt", disk / "optimizer.pt"
    started = time.perf_counter()
    captured.write(model, optimizer)
    for path in (model, optimizer):
        with path.open("rb+") as f:
            os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    written = model.stat().st_size + optimizer.stat().st_size
    raw = disk / "raw.bin"
    block = os.urandom(64 << 20)
    started = time.perf_counter()
    with raw.open("wb") as f:
        for _ in range(written // len(block) + 1):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    raw_s = (time.perf_counter() - started) * written / raw.stat().st_size
    raw.unlink()
    started = time.perf_counter()
    trainer.load_state_files(model, optimizer)
    synchronize(trainer.device)
    restore_s = time.perf_counter() - started
    return {"bytes": written, "capture_s": capture_s, "write_s": write_s, "raw_write_s": raw_s,
            "save_over_raw": (capture_s + write_s) / raw_s, "restore_s": restore_s}


def measure(shape: str, device: torch.device, disk: Path, steps: int, limit: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix=f"scd-{shape}-"))
    from transformers import Qwen2Config

    Qwen2Config(**SHAPES[shape]).save_pretrained(directory)
    write_tokenizer(directory)
    vocab = SHAPES[shape]["vocab_size"]
    fits, tried = largest_fit(directory, device, vocab, limit)
    result: dict[str, Any] = {"groups_tried": tried, "groups_fit": fits}
    if not fits:
        return result
    trainer = trainer_for(directory, device, fits, 1e-6)
    groups = groups_of(fits, vocab)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed_steps(trainer, groups, device, steps)
    parameters = sum({p.data_ptr(): p.numel() for p in trainer.model.parameters()}.values())
    tokens = fits * GROUP_SIZE * (PROMPT + COMPLETION)
    step_s = statistics.median(seconds)
    result |= {"parameters": parameters, "step_s": step_s, "step_s_min": min(seconds), "step_s_max": max(seconds),
               "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
               "mfu": 6 * parameters * tokens / step_s / PEAK_FLOPS, "peak_gib": peak_bytes(device) / 2**30,
               "moved_at_lr_1e-6": moved_shares(trainer, groups)}
    if time.monotonic() - STARTED < BUDGET_S:
        result["state"] = state_paths(trainer, disk)
    del trainer, groups
    release_cached_memory()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU: a smoke test")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = ["tiny"] if args.tiny else ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    summary: dict[str, Any] = {
        "time": time.time(), "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "method": {"rows": f"{GROUP_SIZE} per group, {PROMPT} prompt + {COMPLETION} completion tokens",
                   "trainer": "GRPOTrainer, world size 1, model.dtype bfloat16, fp32 masters, chunked logprobs, "
                              "activation checkpointing", "mfu": f"6 x parameters x tokens / step s / {PEAK_FLOPS:g}"},
    }
    with tempfile.TemporaryDirectory(prefix="scd-gpu-bench-", dir=args.out) as disk:
        for shape in shapes:
            if time.monotonic() - STARTED > BUDGET_S:
                summary[shape] = {"skipped": "past the time budget"}
                continue
            summary[shape] = measure(shape, device, Path(disk), steps=3 if args.tiny else 5,
                                     limit=4 if args.tiny else 32)
            summary["elapsed_s"] = time.monotonic() - STARTED
            (args.out / "gpu_trainer.json").write_text(json.dumps(summary, indent=2))
            print(shape, json.dumps(summary[shape]), flush=True)


if __name__ == "__main__":
    main()
