"""A small pre-LayerNorm causal transformer over scd's character vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from scd.config import ModelConfig


class TinyCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, config.d_model)
        self.position = nn.Embedding(config.max_len, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model, config.n_heads, dim_feedforward=4 * config.d_model, dropout=0.0,
            batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, time, vocab]`` for ``tokens`` ``[batch, time]``."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token(tokens) + self.position(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the weights, safe to hand to another thread."""
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
