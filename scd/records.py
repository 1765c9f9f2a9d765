"""Plain records shared across layers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FinishReason(enum.StrEnum):
    """Why a completion ended.  Only EOS, STOP and LENGTH are complete; anything else is never committed."""

    EOS = "eos"  # the policy's end-of-sequence token (kept as the completion's last token)
    STOP = "stop"  # a stop string (generation.stop) appeared in its text
    LENGTH = "length"  # generation.max_new_tokens reached: truncated
    ABORT = "abort"


COMPLETE = frozenset({FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH})


class WasteReason(enum.StrEnum):
    """Why generated tokens were thrown away (``scd_generation_wasted_tokens_total{reason}``)."""

    STALE_GROUP = "stale_group"  # a ready group evicted outside the staleness window
    STALE_SIBLING = "stale_sibling"  # a finished sibling of an unfinished group, out of the window
    ABORTED = "aborted"  # the partial output of a sibling generation aborted


@dataclass(slots=True)
class Completion:
    """One sibling as a backend returns it: tokens and their logprobs, never a score."""

    token_ids: list[int]
    logprobs: list[float]  # at the sampling temperature, the trainer's convention
    finish_reason: FinishReason
    weight_version: int  # the weights generation started under

    @property
    def truncated(self) -> bool:
        """It reached generation.max_new_tokens with no EOS or stop string."""
        return self.finish_reason is FinishReason.LENGTH


@dataclass(frozen=True, slots=True)
class Prefix:
    """A sibling's tokens so far, with each token's behaviour logprob and weight version: valid to
    resume from whenever it was taken, because tokens only grow."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    # (index of the run's first token, weight version), ascending in both: a weight sync in "keep"
    # mode splits a sequence into runs.
    version_runs: tuple[tuple[int, int], ...]

    @property
    def oldest_version(self) -> int:
        return self.version_runs[0][1]

    def continued(self, token_ids: list[int], logprobs: list[float], finish_reason: FinishReason) -> Completion:
        """The sibling's whole completion: this prefix, then what was generated after it.  Its version
        is the oldest token's: a row's staleness counts from it."""
        return Completion([*self.token_ids, *token_ids], [*self.logprobs, *logprobs], finish_reason,
                          self.oldest_version)


@dataclass(frozen=True, slots=True)
class PartialSibling:
    """A part-way sibling of an in-flight group, as a backend reports it."""

    group_id: str
    index: int
    prefix: Prefix


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
    # It ended by length (FinishReason.LENGTH, generation.max_new_tokens), not at EOS or a stop string:
    # trainer.loss.mask_truncated gives it no loss.
    truncated: bool = False
