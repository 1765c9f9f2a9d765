"""Writing the trainer's state as a DCP checkpoint against the disk: ``python -m bench.trainer_state [DIR]``.

At a Llama of about 100M parameters (hidden 768, 12 layers, vocabulary 32,000, the head tied to the embedding) with
its AdamW state (fp32 weights, ``exp_avg``, ``exp_avg_sq``: ~1.3 GB), ``scd.training.dcp_state.save_trainer_state``
(every rank's files BLAKE3-digested as written and fsynced, ``.metadata`` last) against a raw write + fsync of as
many bytes by one process to the same disk, the two interleaved, 3 times each; at world size 1 in this process and
at 2 on spawned gloo ranks (FSDP2, on loopback).

- ``trainer_state_write_vs_disk_100m_world{1,2}``: the median of the three pairs' ratios (each pair back to back,
  so a disk that slows down for a while slows both), the lowest and highest beside it (the spread: the disk's own
  rate moves severalfold between minutes on a shared box).  Goal <= 1.5.
- ``trainer_state_save_peak_rss_ratio_100m_world{1,2}``: the most rank 0's RSS rose during a save (sampled every
  5 ms) over its share of the state's bytes: the save streams the live tensors without a whole copy.  Goal <= 1.5.
- ``trainer_load_peak_rss_ratio_world2``: the most a rank's RSS rose (sampled every 5 ms, the worse of two ranks)
  while it loaded the model as a sharded ``GRPOTrainer`` does at world size 2 (built on the meta device, sharded,
  filled by ``fill_shards``: each rank reads its own rows of the safetensors) over its share of the model's bytes
  (fp32 masters), at a tied Llama of ~107M parameters (14 layers).  Goal <= 1.5 plus the largest single tensor:
  ``trainer_load_largest_tensor_ratio_world2`` is that allowance on the same scale.
  ``..._broadcast``: the same load with rank 0 reading the whole model and broadcasting it
  (``set_model_state_dict(broadcast_from_rank0=True)``), the way scd did not choose.
  ``..._trainer``: the whole ``GRPOTrainer`` built, the load and its output head's check, a forward through the
  sharded model: FSDP's first forward adds what a first training step would (its all-gathers, kept by the
  allocator), not weights.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import cast

import anyio
import orjson
import torch
import torch.distributed as dist

from scd.config import Config, derive_config
from scd.model.policy import Policy
from scd.training.dcp_state import save_trainer_state

REPO = Path(__file__).resolve().parents[1]

GOALS = {f"trainer_state_{figure}_100m_world{world}": ("<=", 1.5)
         for figure in ("write_vs_disk", "save_peak_rss_ratio") for world in (1, 2)} | {
    "trainer_load_peak_rss_ratio_world2": ("<=", 1.5)}
REPEATS = 3
LOAD_MODEL = "llama-100m"
RANK_TIMEOUT_S = 900


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The 100M Llama (FSDP2-sharded when a process group is up) after one AdamW step on one short row: the
    optimizer holds its whole state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32_000, hidden_size=768, intermediate_size=2048,
                                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                         tie_word_embeddings=True))
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32_000, (1, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest RSS seen, sampled on a thread of its own, from entering to leaving the block."""

    def __init__(self) -> None:
        self.peak = 0
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def raw_write_seconds(path: Path, size: int, block: bytes) -> float:
    """Seconds to write ``size`` bytes of ``block`` to ``path`` and fsync them."""
    started = time.perf_counter()
    with path.open("wb") as f:
        for offset in range(0, size, len(block)):
            f.write(block[:min(len(block), size - offset)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure(directory: Path) -> dict[str, float]:
    """Blocking: the interleaved saves (every rank) and raw writes (rank 0's, as many bytes as all ranks saved)
    under ``directory``; the figures on rank 0 (world size from the default process group, else 1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, optimizer = model_and_optimizer()
    parameters = sum(p.numel() for p in model.parameters())
    block = os.urandom(64 << 20)
    pairs: list[tuple[float, float]] = []
    rises: list[int] = []
    state_bytes = 0
    for repeat in range(REPEATS):
        target = directory / f"state-{repeat}"
        _barrier()
        before = rss_bytes()
        started = time.perf_counter()
        with PeakRss() as peak:
            manifest = save_trainer_state(model, optimizer, target)
        save_s = time.perf_counter() - started  # every rank's files and .metadata written: the manifest gathers
        rises.append(peak.peak - before)
        state_bytes = manifest.total_bytes
        if rank == 0:
            pairs.append((save_s, raw_write_seconds(directory / "raw.bin", state_bytes, block)))
            shutil.rmtree(target)
            (directory / "raw.bin").unlink()
        _barrier()
    ratios = [save_s / raw_s for save_s, raw_s in pairs]
    name = f"100m_world{world}"
    return {} if rank else {
        f"trainer_state_write_vs_disk_{name}": statistics.median(ratios),
        f"trainer_state_write_vs_disk_{name}_min": min(ratios),
        f"trainer_state_write_vs_disk_{name}_max": max(ratios),
        f"trainer_state_write_s_{name}": statistics.median(save_s for save_s, _ in pairs),
        f"trainer_state_raw_write_s_{name}": statistics.median(raw_s for _, raw_s in pairs),
        # What rank 0 adds, against its share of the state.
        f"trainer_state_save_peak_rss_ratio_{name}": max(rises) / (state_bytes / world),
        f"trainer_state_save_peak_rss_mb_{name}": max(rises) / 2**20,
        f"trainer_state_bytes_{name}": state_bytes,
        "trainer_state_parameters_100m": parameters,
    }


def _broadcast_fill(model: torch.nn.Module, policy: Policy, device: torch.device, model_dtype: torch.dtype) -> None:
    """``fill_shards`` the other way: rank 0 reads the whole model and broadcasts it a tensor at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    policy.reset_buffers(model)
    whole = policy.build_model().to(torch.float32).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _sharded_load(config: Config, policy: Policy, fill: Callable[..., None]) -> torch.nn.Module:
    """What a sharded ``GRPOTrainer`` loads (fp32 masters), filled by ``fill``."""
    from scd.training.sharding import shard_model

    model = policy.build_empty_model().to(torch.float32)
    shard_model(model, policy, config.trainer, torch.float32, torch.float32)
    fill(model, policy, torch.device("cpu"), torch.float32)
    return model


def measure_load(directory: Path) -> dict[str, float]:
    """Blocking, on every rank: a sharded trainer's load of directory/llama-100m, the broadcast load, then a whole
    sharded trainer; the figures on rank 0 (the worse rank's rise over a rank's share)."""
    import gc

    from scd.model.policy import build_policy
    from scd.training.grpo import GRPOTrainer
    from scd.training.sharding import fill_shards

    world = dist.get_world_size()
    config = derive_config(REPO / "configs" / "tiny.toml", {"run": {"output_dir": str(directory / "out")}}, {
        "model": {"name": str(directory / LOAD_MODEL)}, "trainer": {"world_size": world}})
    policy = build_policy(config.model, config.run.seed)
    policy.build_empty_model()  # what it imports, outside the figures
    figures: dict[str, float] = {}
    for way, load in (("", lambda: _sharded_load(config, policy, fill_shards)),
                      ("_broadcast", lambda: _sharded_load(config, policy, _broadcast_fill)),
                      ("_trainer", lambda: GRPOTrainer(config, policy, sharded=True).model)):
        gc.collect()
        _barrier()
        before = rss_bytes()
        started = time.perf_counter()
        with PeakRss() as peak:
            loaded = load()
        seconds = time.perf_counter() - started
        rise = torch.tensor([peak.peak - before], dtype=torch.float64)
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)
        if way == "":
            sizes = [p.numel() * p.element_size() for p in loaded.parameters()]
            share = sum(sizes) / world
            figures |= {"trainer_load_largest_tensor_ratio_world2": max(sizes) / share,
                        "trainer_load_model_bytes_world2": float(sum(sizes)),
                        "trainer_load_parameters_world2": float(sum(p.numel() for p in loaded.parameters()))}
        figures |= {f"trainer_load_peak_rss_ratio_world2{way}": float(rise) / share,
                    f"trainer_load_peak_rss_mb_world2{way}": float(rise) / 2**20,
                    f"trainer_load_s_world2{way}": seconds}
        del loaded
    return figures if dist.get_rank() == 0 else {}


def load_on_ranks(directory: Path) -> dict[str, float]:
    """``measure_load`` on two spawned gloo ranks, the tied ~107M Llama written here first."""
    from bench.trainer_memory import write_tied_llama

    write_tied_llama(directory / LOAD_MODEL, vocab_size=32_000, hidden_size=768, layers=14, heads=12)
    return measure_on_ranks(directory, job=measure_load)


def _rank_main(rank: int, world: int, port: int, directory: Path,
               job: Callable[[Path], dict[str, float]] = measure) -> None:
    """One spawned gloo rank: ``job`` (``measure``), rank 0's figures to directory/figures.json."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        figures = job(directory)
        if rank == 0:
            (directory / "figures.json").write_bytes(orjson.dumps(figures))
    finally:
        dist.destroy_process_group()


def measure_on_ranks(directory: Path, world: int = 2,
                     job: Callable[[Path], dict[str, float]] = measure) -> dict[str, float]:
    """``job`` (``measure``) on ``world`` spawned gloo ranks meeting at a TCPStore on loopback (a port the kernel
    picks)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RANK_TIMEOUT_S))
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(rank, world, store.port, directory, job))
             for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(RANK_TIMEOUT_S)
    failed = [(rank, process.exitcode) for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"bench.trainer_state: ranks (rank, exit code) failed: {failed}")
    return cast(dict[str, float], orjson.loads((directory / "figures.json").read_bytes()))


async def figures(tmp: Path) -> dict[str, float]:
    return (await anyio.to_thread.run_sync(measure, tmp) | await anyio.to_thread.run_sync(measure_on_ranks, tmp)
            | await anyio.to_thread.run_sync(load_on_ranks, tmp))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print(orjson.dumps(measure(Path(scratch)) | measure_on_ranks(Path(scratch)) | load_on_ranks(Path(scratch)),
                           option=orjson.OPT_INDENT_2).decode())
