"""The distribution a completion's tokens are drawn from, and their logprobs under it.

Sampling divides the logits by ``generation.temperature``, then keeps the ``top_k`` likeliest tokens
(0: all) and, of those, the smallest set of likeliest tokens holding ``top_p`` of the probability
(1.0: all); the rest get probability 0.  That truncated distribution is the behaviour policy: every
backend reports its sampled tokens' logprobs under it (vLLM's ``processed_logprobs``), and the trainer
recomputes them under the same truncation of its own logits, so the PPO ratio compares the
distributions the tokens were really drawn from.  The masks follow vLLM's ``apply_top_k_top_p``
(ties at a boundary aside), so a token vLLM sampled is kept by the trainer's mask of the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scd.config import GenerationConfig


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off

    @classmethod
    def of(cls, config: GenerationConfig) -> Sampling:
        return cls(config.temperature, config.top_k, config.top_p)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[..., vocab]`` at the temperature, tokens outside the top-k / top-p sets at -inf."""
        scaled = logits / self.temperature
        if not self.top_k and self.top_p >= 1.0:
            return scaled
        ascending, order = scaled.sort(dim=-1)
        dropped = torch.zeros_like(ascending, dtype=torch.bool)
        if self.top_k and self.top_k < ascending.shape[-1]:
            dropped |= ascending < ascending[..., -self.top_k, None]
        if self.top_p < 1.0:
            cumulative = ascending.masked_fill(dropped, -torch.inf).softmax(dim=-1).cumsum(dim=-1)
            below = cumulative <= 1 - self.top_p
            below[..., -1] = False  # the likeliest token always stays
            dropped |= below
        return scaled.masked_fill(dropped.scatter(-1, order, dropped), -torch.inf)

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of the truncated distribution (-inf outside it)."""
        return F.log_softmax(self.logits(logits), dim=-1)
