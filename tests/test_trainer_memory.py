"""What one GRPO step holds beside the model: the bound ``trainer_logprob_peak_rss_ratio`` claims, asserted at a
shape cheap enough for the suite (bench/trainer_memory.py measures it at 16 × 1,024 tokens, vocab 32,000)."""

from __future__ import annotations

import pytest

from bench.trainer_memory import StepShape, step_rise

# 2,048 completion tokens at vocab 32,000 (one fp32 logits tensor: 250 MiB), in chunks of 128 tokens (16 MiB).
SHAPE = StepShape(rows=16, prompt=8, completion=120, vocab=32_000, chunk_tokens=128)


@pytest.mark.slow  # a subprocess per case: peak RSS is a process's own
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01], ids=["no_bonus", "entropy_bonus"])
def test_a_step_adds_at_most_half_a_logits_tensor_with_and_without_an_entropy_bonus(entropy_coef: float) -> None:
    """With the default ``entropy_coef = 0`` the entropy is measured but never in backward: it must keep no chunk's
    recomputed ``[chunk, vocab]`` intermediates alive to the step's end (they made 2 logits tensors' worth)."""
    rise = step_rise("chunked", SHAPE, entropy_coef, mmap_threshold=1 << 20)
    print(f"entropy_coef {entropy_coef}: rise {rise.rise_bytes / 2**20:.0f} MiB, ratio {rise.ratio:.3f}")
    assert rise.chunk_tokens == SHAPE.chunk_tokens
    assert rise.ratio <= 0.5, f"{rise.rise_bytes / 2**20:.0f} MiB over a warmed-up step"
