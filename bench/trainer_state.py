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
from datetime import timedelta
from pathlib import Path
from typing import cast

import anyio
import orjson
import torch
import torch.distributed as dist

from scd.training.dcp_state import save_trainer_state

GOALS = {f"trainer_state_{figure}_100m_world{world}": ("<=", 1.5)
         for figure in ("write_vs_disk", "save_peak_rss_ratio") for world in (1, 2)}
REPEATS = 3
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


def _rank_main(rank: int, world: int, port: int, directory: Path) -> None:
    """One spawned gloo rank: ``measure``, rank 0's figures to directory/figures.json."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        figures = measure(directory)
        if rank == 0:
            (directory / "figures.json").write_bytes(orjson.dumps(figures))
    finally:
        dist.destroy_process_group()


def measure_on_ranks(directory: Path, world: int = 2) -> dict[str, float]:
    """``measure`` on ``world`` spawned gloo ranks meeting at a TCPStore on loopback (a port the kernel picks)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RANK_TIMEOUT_S))
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(rank, world, store.port, directory)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(RANK_TIMEOUT_S)
    failed = [(rank, process.exitcode) for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"bench.trainer_state: ranks (rank, exit code) failed: {failed}")
    return cast(dict[str, float], orjson.loads((directory / "figures.json").read_bytes()))


async def figures(tmp: Path) -> dict[str, float]:
    return await anyio.to_thread.run_sync(measure, tmp) | await anyio.to_thread.run_sync(measure_on_ranks, tmp)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print(orjson.dumps(measure(Path(scratch)) | measure_on_ranks(Path(scratch)),
                           option=orjson.OPT_INDENT_2).decode())
