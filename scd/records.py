"""Plain records shared across layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Rollout:
    """One sibling of a group, as stored in TQ."""

    input_ids: torch.Tensor  # int64 [prompt_len + completion_len]
    logprobs: torch.Tensor  # float32 [completion_len], under the weights that sampled it
    prompt_len: int
    reward: float
    weight_version: int
