"""What the trainer costs beside its arithmetic, on the CPU: ``python -m bench.run trainer_memory``.

Capture: a 96M-parameter Hugging Face Llama whose output head is its embedding (tied, as Qwen2.5-0.5B's;
width 1,024, 6 layers, vocabulary 32,000) with its AdamW state, copied for a checkpoint off the event loop
as the checkpointer does, while a probe measures how late the loop wakes
(``trainer_capture_loop_stall_p99_ms``), against the same copy made on the loop (its length is the stall it
was); and the bytes the copy writes against the unique parameter and optimizer bytes
(``trainer_bundle_bytes_ratio``: a tied tensor saved twice would show as 1.3).  The suite asserts the
bytes bound on a small tied Llama (``bundle_bytes_ratio`` is what both call).

Logprob memory:

One GRPO step at world size 1 over 16 rows of 1,024 tokens (24 prompt, 1,000 completion) with a
vocabulary of 32,000, on a 2-layer Llama of width 64 (so the logits, not the model, are what a step
holds).  Each mode runs in a process of its own, and its peak RSS over the step is measured against the
same process after a warm-up step of 2 rows: "chunked" is the trainer as it is (completion tokens'
logits a chunk at a time, recomputed in backward) with the default ``trainer.entropy_coef = 0``
(``trainer_logprob_peak_rss_ratio``) and with an entropy bonus of 0.01 (``..._bonus_ratio``); "full"
computes ``[rows, length, vocab]`` fp32 logits and their log-softmax for the whole step, kept through
backward, as the trainer did before.  The goal: the chunked step's rise is at most half of one fp32
logits tensor (16 × 1,024 × 32,000 × 4 bytes), with and without the bonus.  The suite asserts the same
bound at a smaller shape (``step_rise`` is what both call).

``python -m bench.trainer_memory chunked|full [ENTROPY_COEF]`` prints one mode's rise at the bench's shape.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import anyio
import orjson
import torch

from bench.summary import percentile, probe_loop

if TYPE_CHECKING:
    from scd.training.grpo import GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
GOALS = {"trainer_logprob_peak_rss_ratio": ("<=", 0.5), "trainer_logprob_peak_rss_bonus_ratio": ("<=", 0.5),
         "trainer_capture_loop_stall_p99_ms": ("<=", 50.0), "trainer_bundle_bytes_ratio": ("<=", 1.02)}
BONUS = 0.01
Mode = Literal["chunked", "full"]


@dataclass(frozen=True, slots=True)
class StepShape:
    """One measured step: ``rows`` of ``prompt`` + ``completion`` tokens over ``vocab``."""

    rows: int
    prompt: int
    completion: int
    vocab: int
    chunk_tokens: int = 0  # trainer.logprob_chunk_tokens (0: auto)

    @property
    def logits_bytes(self) -> int:
        """One fp32 logits tensor of the whole step: what the rise is measured against."""
        return self.rows * (self.prompt + self.completion) * self.vocab * 4


BENCH_SHAPE = StepShape(rows=16, prompt=24, completion=1000, vocab=32_000)


@dataclass(frozen=True, slots=True)
class StepRise:
    rise_bytes: int
    chunk_tokens: int
    logits_bytes: int

    @property
    def ratio(self) -> float:
        return self.rise_bytes / self.logits_bytes


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure_in_this_process(mode: Mode, shape: StepShape, entropy_coef: float, directory: Path) -> StepRise:
    """The peak RSS the big step adds over a warmed-up trainer (meaningful only in a fresh process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scd.config import parse_config
    from scd.model.init_tiny import write_tokenizer
    from scd.model.policy import build_policy
    from scd.records import Rollout
    from scd.training.grpo import GRPOTrainer, completion_logprobs

    write_tokenizer(directory)
    LlamaForCausalLM(LlamaConfig(vocab_size=shape.vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=False)).save_pretrained(directory)
    config = parse_config({"run": {"output_dir": str(directory)}, "model": {"name": str(directory)},
                           "trainer": {"lr": 1e-4, "groups_per_step": 2, "entropy_coef": entropy_coef,
                                       "logprob_chunk_tokens": shape.chunk_tokens}}, directory)
    trainer = GRPOTrainer(config, build_policy(config.model, 0))
    if mode == "full":
        def full(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logp = trainer.sampling.logprobs(trainer.policy.logits(trainer.model, tokens))
            kept = logp[:, :-1]
            return (completion_logprobs(logp, tokens).masked_fill(mask == 0, 0.0),
                    -(kept.exp() * kept.masked_fill(kept.isinf(), 0.0)).sum(-1))

        trainer.completion_token_logprobs = full  # type: ignore[method-assign]

    def rows(count: int) -> list[list[Rollout]]:
        made = [Rollout(torch.randint(4, shape.vocab, (shape.prompt + shape.completion,)),
                        torch.full((shape.completion,), -10.0), shape.prompt, reward=float(i % 2), weight_version=0)
                for i in range(count)]
        return [made[: count // 2], made[count // 2:]]

    trainer.step(rows(2), weight_version=0)
    before = _peak_rss_bytes()
    trainer.step(rows(shape.rows), weight_version=0)
    return StepRise(_peak_rss_bytes() - before, trainer.chunk_tokens, shape.logits_bytes)


def step_rise(mode: Mode, shape: StepShape, entropy_coef: float, *, mmap_threshold: int | None = None) -> StepRise:
    """``mode``'s peak RSS rise over one step of ``shape``, measured in a fresh process.

    ``mmap_threshold`` pins glibc's (``MALLOC_MMAP_THRESHOLD_``): a block at least that large is mapped and
    unmapped on its own, so peak RSS follows the tensors alive.  Unpinned (the default, as a user's process
    runs), glibc raises it up to 32 MiB as blocks are freed and keeps freed blocks below it in its heap:
    at a shape whose chunks are that small, what the heap keeps swamps what the step holds."""
    env = os.environ | ({"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {})
    out = subprocess.run([sys.executable, "-m", "bench.trainer_memory", mode, str(entropy_coef),
                          orjson.dumps(asdict(shape)).decode()], cwd=REPO, env=env, check=True, capture_output=True,
                         timeout=900)
    return StepRise(**orjson.loads(out.stdout.splitlines()[-1]))


def write_tied_llama(directory: Path, *, vocab_size: int, hidden_size: int, layers: int, heads: int) -> Path:
    """A random HF Llama whose output head is its embedding, with scd's character tokenizer, in ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scd.model.init_tiny import write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                 tie_word_embeddings=True)).save_pretrained(directory)
    return directory


def bundle_bytes_ratio(trainer: GRPOTrainer, directory: Path) -> float:
    """The bytes a capture of ``trainer`` writes (weights and optimizer files) over its unique parameter and
    optimizer state bytes (``parameters()`` yields a tied parameter once)."""
    trainer.capture_state().write(directory / "model.pt", directory / "optimizer.pt")
    unique = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) + sum(
        t.numel() * t.element_size() for state in trainer.optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor))
    return ((directory / "model.pt").stat().st_size + (directory / "optimizer.pt").stat().st_size) / unique


async def capture_figures(tmp: Path, rounds: int = 3) -> dict[str, float]:
    from scd.config import parse_config
    from scd.model.policy import build_policy
    from scd.records import Rollout
    from scd.training.grpo import GRPOTrainer

    model = write_tied_llama(tmp / "tied-llama", vocab_size=32_000, hidden_size=1024, layers=6, heads=8)
    config = parse_config({"run": {"output_dir": str(tmp)}, "model": {"name": str(model)},
                           "trainer": {"groups_per_step": 2}}, tmp)
    trainer = GRPOTrainer(config, build_policy(config.model, 0))
    rows = [[Rollout(torch.randint(4, 40, (16,)), torch.full((8,), -3.0), 8, reward=float(i % 2), weight_version=0)
             for i in range(2)] for _ in range(2)]
    trainer.step(rows, weight_version=0)  # AdamW state to copy
    stalls: list[float] = []
    on_loop: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe_loop, stalls)
        for _ in range(rounds):
            await anyio.sleep(0.2)
            await anyio.to_thread.run_sync(trainer.capture_state)
        tg.cancel_scope.cancel()
    for _ in range(rounds):
        started = time.monotonic()
        trainer.capture_state()
        on_loop.append(time.monotonic() - started)
    return {
        "trainer_capture_loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
        "trainer_capture_loop_stall_max_ms": 1000 * max(stalls),
        "trainer_capture_on_loop_ms": 1000 * statistics.median(on_loop),
        "trainer_capture_parameters_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "trainer_bundle_bytes_ratio": bundle_bytes_ratio(trainer, tmp),
    }


async def figures(tmp: Path) -> dict[str, float]:
    summary = await capture_figures(tmp)
    chunked, bonus, full = [await anyio.to_thread.run_sync(step_rise, mode, BENCH_SHAPE, coef)
                            for mode, coef in (("chunked", 0.0), ("chunked", BONUS), ("full", 0.0))]
    return summary | {
        "trainer_logprob_peak_rss_ratio": chunked.ratio,
        "trainer_logprob_peak_rss_bonus_ratio": bonus.ratio,
        "trainer_logprob_peak_rss_full_ratio": full.ratio,
        "trainer_logprob_peak_rss_chunked_mb": chunked.rise_bytes / 2**20,
        "trainer_logprob_peak_rss_bonus_mb": bonus.rise_bytes / 2**20,
        "trainer_logprob_peak_rss_full_mb": full.rise_bytes / 2**20,
        "trainer_logprob_chunk_tokens": chunked.chunk_tokens,
        "trainer_logits_tensor_mb": BENCH_SHAPE.logits_bytes / 2**20,
    }


if __name__ == "__main__":
    torch.set_num_threads(2)
    mode: Mode = sys.argv[1]  # type: ignore[assignment]
    coef = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    shape = StepShape(**orjson.loads(sys.argv[3])) if len(sys.argv) > 3 else BENCH_SHAPE
    with tempfile.TemporaryDirectory() as scratch:
        print(orjson.dumps(asdict(_measure_in_this_process(mode, shape, coef, Path(scratch)))).decode())
