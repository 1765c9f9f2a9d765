"""Plain records shared across layers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FinishReason(enum.StrEnum):
    """Why a completion ended.  Only LENGTH and STOP are complete; anything else is never committed."""

    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


COMPLETE = frozenset({FinishReason.LENGTH, FinishReason.STOP})


@dataclass(slots=True)
class Completion:
    """One sibling as a backend returns it: tokens and their logprobs, never a score."""

    token_ids: list[int]
    logprobs: list[float]  # at the sampling temperature, the trainer's convention
    finish_reason: FinishReason
    weight_version: int  # the weights generation started under


@dataclass(slots=True)
class Rollout:
    """One scored sibling of a group, as stored in TQ and trained on."""

    input_ids: torch.Tensor  # int64 [prompt_len + completion_len]
    logprobs: torch.Tensor  # float32 [completion_len], under the weights that sampled it
    prompt_len: int
    reward: float
    weight_version: int
    # Every token was sampled under this one version (no weight sync landed mid-completion).
    single_version: bool = True
