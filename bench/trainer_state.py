"""Writing the trainer's state as a DCP checkpoint against the disk: ``python -m bench.trainer_state``.

At a Llama of about 100M parameters (hidden 768, 12 layers, vocabulary 32,000, the head tied to the embedding) with
its AdamW state (fp32 weights, ``exp_avg``, ``exp_avg_sq``: ~1.3 GB), ``scd.training.dcp_state.save_trainer_state``
at world size 1 (every file BLAKE3-digested as written, fsynced) against a raw write + fsync of as many bytes to
the same disk, the two interleaved, 3 times each: ``trainer_state_write_vs_disk_100m_world1`` is the median of
the three pairs' ratios (each pair measured back to back, so a disk that slows down for a while slows both), with
the lowest and highest beside it (the spread: the disk's own figure moves severalfold on a shared box).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import orjson
import torch

from scd.training.dcp_state import save_trainer_state

GOALS = {"trainer_state_write_vs_disk_100m_world1": ("<=", 1.5),
         "trainer_state_save_peak_rss_ratio_100m_world1": ("<=", 1.5)}
REPEATS = 3


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The 100M Llama after one AdamW step on one short row: the optimizer holds its whole state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32_000, hidden_size=768, intermediate_size=2048,
                                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                         tie_word_embeddings=True))
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


def measure(directory: Path) -> dict[str, float]:
    """Blocking: the interleaved saves and raw writes under ``directory``."""
    model, optimizer = model_and_optimizer()
    parameters = sum(p.numel() for p in model.parameters())
    block = os.urandom(64 << 20)
    pairs: list[tuple[float, float, int]] = []
    rises: list[int] = []
    for repeat in range(REPEATS):
        target = directory / f"state-{repeat}"
        before = rss_bytes()
        started = time.perf_counter()
        with PeakRss() as peak:
            manifest = save_trainer_state(model, optimizer, target)
        save_s = time.perf_counter() - started
        rises.append(peak.peak - before)
        raw_s = raw_write_seconds(directory / "raw.bin", manifest.total_bytes, block)
        pairs.append((save_s, raw_s, manifest.total_bytes))
        shutil.rmtree(target)
        (directory / "raw.bin").unlink()
    ratios = [save_s / raw_s for save_s, raw_s, _ in pairs]
    state_bytes = pairs[0][2]
    return {
        "trainer_state_write_vs_disk_100m_world1": statistics.median(ratios),
        "trainer_state_write_vs_disk_100m_world1_min": min(ratios),
        "trainer_state_write_vs_disk_100m_world1_max": max(ratios),
        "trainer_state_write_s_100m_world1": statistics.median(save_s for save_s, _, _ in pairs),
        "trainer_state_raw_write_s_100m_world1": statistics.median(raw_s for _, raw_s, _ in pairs),
        "trainer_state_save_peak_rss_ratio_100m_world1": max(rises) / state_bytes,
        "trainer_state_save_peak_rss_mb_100m_world1": max(rises) / 2**20,
        "trainer_state_bytes_100m": state_bytes,
        "trainer_state_parameters_100m": parameters,
    }


async def figures(tmp: Path) -> dict[str, float]:
    return await anyio.to_thread.run_sync(measure, tmp)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as scratch:
        print(orjson.dumps(measure(Path(scratch)), option=orjson.OPT_INDENT_2).decode())
