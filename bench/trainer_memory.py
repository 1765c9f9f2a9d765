"""What the trainer costs beside its arithmetic, on the CPU: ``python -m bench.run trainer_memory``.

Capture: a 100M-parameter model (scd's tiny transformer at width 1,024, 8 layers) with its AdamW state,
copied for a checkpoint off the event loop as the checkpointer does, while a probe measures how late the
loop wakes (``trainer_capture_loop_stall_p99_ms``), against the same copy made on the loop (its length is
the stall it was); and the bytes the copy writes against the unique parameter and optimizer bytes
(``trainer_bundle_bytes_ratio``).

Logprob memory:

One GRPO step at world size 1 over 16 rows of 1,024 tokens (24 prompt, 1,000 completion) with a
vocabulary of 32,000, on a 2-layer Llama of width 64 (so the logits, not the model, are what a step
holds).  Each mode runs in a process of its own, and its peak RSS over the step is measured against the
same process after a warm-up step of 2 rows: "chunked" is the trainer as it is (completion tokens'
logits a chunk at a time, recomputed in backward); "full" computes ``[rows, length, vocab]`` fp32 logits
and their log-softmax for the whole step, kept through backward, as the trainer did before.  The goal:
the chunked step's rise is at most half of one fp32 logits tensor (16 × 1,024 × 32,000 × 4 bytes).
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import orjson
import torch

from bench.summary import percentile, probe_loop

ROWS, PROMPT, COMPLETION, VOCAB = 16, 24, 1000, 32_000
LOGITS_BYTES = ROWS * (PROMPT + COMPLETION) * VOCAB * 4
GOALS = {"trainer_logprob_peak_rss_ratio": ("<=", 0.5), "trainer_capture_loop_stall_p99_ms": ("<=", 50.0),
         "trainer_bundle_bytes_ratio": ("<=", 1.02)}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step_rise(mode: str, directory: Path) -> dict[str, float]:
    """Runs in its own process: the peak RSS the big step adds over a warmed-up trainer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scd.config import parse_config
    from scd.model.init_tiny import write_tokenizer
    from scd.model.policy import build_policy
    from scd.records import Rollout
    from scd.training.grpo import GRPOTrainer, completion_logprobs

    write_tokenizer(directory)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=False)).save_pretrained(directory)
    config = parse_config({"run": {"output_dir": str(directory)}, "model": {"name": str(directory)},
                           "trainer": {"lr": 1e-4, "groups_per_step": 2}}, directory)
    trainer = GRPOTrainer(config, build_policy(config.model, 0))
    if mode == "full":
        def full(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logp = trainer.sampling.logprobs(trainer.policy.logits(trainer.model, tokens))
            kept = logp[:, :-1]
            return (completion_logprobs(logp, tokens).masked_fill(mask == 0, 0.0),
                    -(kept.exp() * kept.masked_fill(kept.isinf(), 0.0)).sum(-1))

        trainer.completion_token_logprobs = full  # type: ignore[method-assign]

    def rows(count: int) -> list[list[Rollout]]:
        made = [Rollout(torch.randint(4, VOCAB, (PROMPT + COMPLETION,)), torch.full((COMPLETION,), -10.0), PROMPT,
                        reward=float(i % 2), weight_version=0) for i in range(count)]
        return [made[: count // 2], made[count // 2:]]

    trainer.step(rows(2), weight_version=0)
    before = _peak_rss_bytes()
    trainer.step(rows(ROWS), weight_version=0)
    return {"rise_bytes": _peak_rss_bytes() - before, "chunk_tokens": trainer.chunk_tokens}


async def capture_figures(tmp: Path, rounds: int = 3) -> dict[str, float]:
    from scd.config import parse_config
    from scd.model.policy import build_policy
    from scd.records import Rollout
    from scd.training.grpo import GRPOTrainer

    config = parse_config({"run": {"output_dir": str(tmp)}, "model": {"d_model": 1024, "n_layers": 8, "n_heads": 8},
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
        captured = trainer.capture_state()
        on_loop.append(time.monotonic() - started)
    captured.write(tmp / "model.pt", tmp / "optimizer.pt")
    unique = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) + sum(
        t.numel() * t.element_size() for state in trainer.optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor))
    written = (tmp / "model.pt").stat().st_size + (tmp / "optimizer.pt").stat().st_size
    return {
        "trainer_capture_loop_stall_p99_ms": 1000 * percentile(stalls, 0.99),
        "trainer_capture_loop_stall_max_ms": 1000 * max(stalls),
        "trainer_capture_on_loop_ms": 1000 * statistics.median(on_loop),
        "trainer_capture_parameters_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "trainer_bundle_bytes_ratio": written / unique,
    }


async def figures(tmp: Path) -> dict[str, float]:
    summary = await capture_figures(tmp)
    rises = {}
    for mode in ("chunked", "full"):
        out = subprocess.run([sys.executable, "-m", "bench.trainer_memory", mode], check=True, capture_output=True,
                             timeout=900)
        rises[mode] = orjson.loads(out.stdout.splitlines()[-1])
    return summary | {
        "trainer_logprob_peak_rss_ratio": rises["chunked"]["rise_bytes"] / LOGITS_BYTES,
        "trainer_logprob_peak_rss_full_ratio": rises["full"]["rise_bytes"] / LOGITS_BYTES,
        "trainer_logprob_peak_rss_chunked_mb": rises["chunked"]["rise_bytes"] / 2**20,
        "trainer_logprob_peak_rss_full_mb": rises["full"]["rise_bytes"] / 2**20,
        "trainer_logprob_chunk_tokens": rises["chunked"]["chunk_tokens"],
        "trainer_logits_tensor_mb": LOGITS_BYTES / 2**20,
    }


if __name__ == "__main__":
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        print(orjson.dumps(_step_rise(sys.argv[1], Path(scratch))).decode())
