"""The GRPO loss and each of its options, defined once as pure functions over ``[rows, positions]`` tensors.

Every completion token has three logprobs:

- **behaviour**: the engine's, recorded with the tokens (``Rollout.logprobs``);
- **proximal**: the trainer's under the weights this step starts from, computed without gradients;
- **current**: the trainer's under the weights being updated, with gradients.

The clip bounds current ÷ proximal: the trust region around the weights the step starts from.  The
off-policy correction weights each token by proximal ÷ behaviour: how much likelier the trainer finds the
token than the engine that drew it, whether the engine's weights were stale or its numerics differ.  Without
a proximal (no correction asked for, one optimizer step per train step) the clip anchors to the behaviour
logprobs, as scd always has: the default settings are that loss, bit for bit.  While a step has taken no
optimizer step yet the proximal logprobs are the current ones, detached (same weights, same pass): an extra
forward without gradients, before the step's first update, is needed only for the rows of its later
mini-batches.

Definitions, with ``r = proximal ÷ behaviour`` per token and the peers' names for the same thing:

- ``tis``: weight ``min(r, is_cap)`` (verl ``rollout_is: token``, NeMo-RL ``tis``, SkyRL token TIS);
- ``mis``: weight 1 where ``is_low <= r <= is_high``, else 0: the token is rejected, not reweighted
  (verl ``rollout_rs: token`` without IS weights, SkyRL's token mask);
- ``icepop``: weight ``r`` where ``is_low <= r <= is_high``, else 0 (NeMo-RL and OpenRLHF ``icepop``);
- ``seq_tis``: every token of a completion weighted ``min(prod_t r_t, is_cap)`` (verl ``rollout_is:
  sequence``, SkyRL sequence TIS);
- ``seq_mask_tis``: weight ``r`` in a completion whose geometric-mean ratio ``exp(mean_t log r_t)`` is in
  ``[is_low, is_high]``, else 0 for all its tokens (NeMo-RL and OpenRLHF ``seq-mask-tis``).

A masked token keeps its place in the normaliser (NeMo-RL's and OpenRLHF's choice, not verl's): the
normaliser is counted over the whole step before any rank computes a logprob, so the gradients summed over
ranks stay world size 1's without a second exchange.  Log ratios are bounded to ±20 before ``exp`` (verl,
SkyRL), so a weight is never inf and a 0-weighted token never turns the loss NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from scd.config import LossAggregation, LossConfig
from scd.errors import ConfigError

KLEstimator = Literal["k1", "k2", "k3"]

# exp(±20) ≈ 5e8 / 2e-9: far past any cap or mask band, and finite in every float dtype the loss runs in.
LOG_RATIO_BOUND = 20.0


class LossSettings(LossConfig):
    """What ``policy_loss`` computes: ``[trainer.loss]`` and the options built here that no config key sets
    yet (a reference KL needs a frozen reference model); ``of`` gives the configured loss."""

    # > 0 adds kl_coef times the KL to a frozen reference policy to the loss.
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"

    @classmethod
    def of(cls, config: LossConfig) -> LossSettings:
        return cls(**msgspec.structs.asdict(config))

    def check(self) -> None:
        """Raise ``ConfigError`` naming the first key whose value makes no loss."""
        super().check()
        if self.kl_coef < 0:
            raise ConfigError("trainer.loss.kl_coef", f"must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True, slots=True)
class StepSize:
    """What a step's loss is divided by, counted over the whole step (every rank's rows) before it trains:
    each rank divides its own sum by it, so the gradients summed over ranks are world size 1's."""

    # Trained completion tokens and completions of the whole step (truncated ones left out under
    # mask_truncated: they carry no loss).
    tokens: int
    sequences: int
    # Dr. GRPO's constant: every completion's token budget (generation.max_new_tokens).
    max_completion_tokens: int

    @classmethod
    def of(cls, completion_lengths: Sequence[int], truncated: Sequence[bool], settings: LossSettings,
           max_completion_tokens: int) -> StepSize:
        """The size of a step whose completions have ``completion_lengths`` tokens and ended by length where
        ``truncated``."""
        trained = [n for n, cut in zip(completion_lengths, truncated, strict=True)
                   if not (settings.mask_truncated and cut)]
        return cls(tokens=sum(trained), sequences=len(trained), max_completion_tokens=max_completion_tokens)

    def normaliser(self, aggregation: LossAggregation) -> int:
        """The divisor of ``aggregate_sum``'s numerator; at least 1, so a step whose every completion is masked
        has loss 0, not NaN."""
        count = {"token_mean": self.tokens, "seq_mean_token_mean": self.sequences,
                 "seq_mean_token_sum_norm": self.sequences * self.max_completion_tokens}[aggregation]
        return max(count, 1)


def group_advantages(rewards: torch.Tensor, eps: float, *, normalize_std: bool = True) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group; ``r - mean`` without ``normalize_std`` (Dr. GRPO: the
    std division weighs groups whose rewards barely differ most)."""
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if normalize_std else centred


def step_advantages(group_rewards: Sequence[Sequence[float]], eps: float, *,
                    normalize_std: bool = True) -> torch.Tensor:
    """Every row's advantage ``[rows]``, the groups' rows one after another."""
    return torch.cat([group_advantages(torch.tensor(list(rewards)), eps, normalize_std=normalize_std)
                      for rewards in group_rewards])


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> torch.Tensor:
    """PPO's per-token loss ``-min(ratio·A, clip(ratio, 1 - clip_low, 1 + clip_high)·A)`` for ``ratio``
    ``[rows, positions]`` and ``advantages`` ``[rows]``: a token whose ratio left the range on the side its
    advantage pushes towards adds no gradient."""
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def importance_log_ratios(proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """``log(proximal ÷ behaviour)`` per token, bounded to ±``LOG_RATIO_BOUND`` (a proximal logprob of -inf,
    a token outside the trainer's top-k / top-p set, reads as a ratio of about 0)."""
    return (proximal - behaviour).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def correction_weights(log_ratio: torch.Tensor, mask: torch.Tensor,
                       settings: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's weight in the loss under ``settings.off_policy_correction``, from ``importance_log_ratios``,
    and where the correction changed it (capped or masked).  The weights carry no gradient: they say how much a
    token counts, not which way to move."""
    log_ratio = log_ratio.detach()
    ratio = log_ratio.exp()
    kind = settings.off_policy_correction
    if kind == "none":
        return torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    if kind == "tis":
        return ratio.clamp(max=settings.is_cap), ratio > settings.is_cap
    if kind in ("mis", "icepop"):
        inside = (ratio >= settings.is_low) & (ratio <= settings.is_high)
        kept = inside.to(ratio.dtype) if kind == "mis" else torch.where(inside, ratio, 0.0)
        return kept, ~inside
    sequence_log_ratio = (log_ratio * mask).sum(-1, keepdim=True)
    if kind == "seq_tis":
        sequence_ratio = sequence_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        return (sequence_ratio.clamp(max=settings.is_cap).expand_as(ratio),
                (sequence_ratio > settings.is_cap).expand_as(ratio))
    geometric_mean = (sequence_log_ratio / mask.sum(-1, keepdim=True).clamp(min=1)).exp()
    kept_sequence = (geometric_mean >= settings.is_low) & (geometric_mean <= settings.is_high)
    return torch.where(kept_sequence, ratio, 0.0), (~kept_sequence).expand_as(ratio)


def kl_estimate(log_ratio: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Schulman's per-token estimators of ``KL(sampler ‖ other)`` from ``log_ratio = log(other ÷ sampler)`` on
    tokens drawn from the sampler: k1 ``-log_ratio`` (unbiased, can be negative), k2 ``log_ratio² / 2`` (low
    variance, biased), k3 ``exp(log_ratio) - 1 - log_ratio`` (unbiased, never negative)."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return log_ratio.exp() - 1 - log_ratio


def aggregate_sum(values: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation) -> torch.Tensor:
    """The numerator of the step's loss from per-token ``values`` over this rank's rows; divided by
    ``StepSize.normaliser`` it is: the mean over the step's tokens (token_mean), the mean over its completions
    of each one's token mean (seq_mean_token_mean), or the sum over its tokens divided by completions ×
    token budget (seq_mean_token_sum_norm)."""
    masked = values * mask
    if aggregation == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return masked.sum()


@dataclass(frozen=True, slots=True)
class RatioSums:
    """A step's statistics as sums (and a max) over tokens, which add up across ranks and staleness lags."""

    tokens: float
    clipped: float  # tokens whose current ÷ proximal ratio left [1 - clip_low, 1 + clip_high]
    is_ratio_sum: float  # proximal ÷ behaviour
    is_ratio_max: float
    corrected: float  # tokens whose weight the off-policy correction capped or masked
    behaviour_kl_sum: float  # k3 estimate of KL(behaviour ‖ proximal)
    reference_kl_sum: float  # the configured estimate of KL(current ‖ reference); 0 without one
    entropy_sum: float

    def __add__(self, other: RatioSums) -> RatioSums:
        return RatioSums(
            tokens=self.tokens + other.tokens, clipped=self.clipped + other.clipped,
            is_ratio_sum=self.is_ratio_sum + other.is_ratio_sum,
            is_ratio_max=max(self.is_ratio_max, other.is_ratio_max), corrected=self.corrected + other.corrected,
            behaviour_kl_sum=self.behaviour_kl_sum + other.behaviour_kl_sum,
            reference_kl_sum=self.reference_kl_sum + other.reference_kl_sum,
            entropy_sum=self.entropy_sum + other.entropy_sum,
        )


@dataclass(frozen=True, slots=True)
class TokenStatistics:
    """Per row ``[rows]``, sums over its trained tokens, detached: a step reports them summed over all rows,
    or over the rows of one staleness lag (``sums``)."""

    tokens: torch.Tensor
    clipped: torch.Tensor
    is_ratio_sum: torch.Tensor
    is_ratio_max: torch.Tensor  # 0 for a row with no trained token
    corrected: torch.Tensor
    behaviour_kl_sum: torch.Tensor
    reference_kl_sum: torch.Tensor
    entropy_sum: torch.Tensor

    def sums(self, rows: torch.Tensor | None = None) -> RatioSums:
        """The sums over ``rows`` (a boolean ``[rows]`` selection; all rows without one)."""
        def total(values: torch.Tensor) -> float:
            return float(values.sum() if rows is None else values[rows].sum())

        maxima = self.is_ratio_max if rows is None else self.is_ratio_max[rows]
        return RatioSums(
            tokens=total(self.tokens), clipped=total(self.clipped), is_ratio_sum=total(self.is_ratio_sum),
            is_ratio_max=float(maxima.max()) if maxima.numel() else 0.0, corrected=total(self.corrected),
            behaviour_kl_sum=total(self.behaviour_kl_sum), reference_kl_sum=total(self.reference_kl_sum),
            entropy_sum=total(self.entropy_sum),
        )


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    loss: torch.Tensor  # this rank's share of the step's loss, with gradients
    statistics: TokenStatistics


def policy_loss(current: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                size: StepSize, settings: LossSettings, *, proximal: torch.Tensor | None = None,
                reference: torch.Tensor | None = None, truncated: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0) -> PolicyLoss:
    """This rank's share of the step's loss and its per-row statistics.

    ``current``, ``behaviour``, ``proximal`` and ``reference`` (the frozen reference policy's, needed when
    ``kl_coef > 0``) are logprobs ``[rows, positions]``, ``mask`` 1.0 on completion tokens; ``advantages``
    ``[rows]``; ``truncated`` (needed under ``mask_truncated``) says per row whether it ended by length;
    ``entropy`` per token, in the loss with ``entropy_coef``.  Without ``proximal`` the clip anchors to
    ``behaviour`` and no correction applies; the statistics then measure current ÷ behaviour, which is
    proximal ÷ behaviour when the step has one optimizer step.
    """
    if proximal is None and settings.off_policy_correction != "none":
        raise ValueError(f"off_policy_correction = {settings.off_policy_correction!r} needs the proximal logprobs")
    if reference is None and settings.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
    if settings.mask_truncated:
        if truncated is None:
            raise ValueError("mask_truncated needs each row's truncated flag")
        mask = mask * (~truncated).to(mask.dtype).unsqueeze(1)
    ratio = torch.exp(current - (behaviour if proximal is None else proximal))
    surrogate = clipped_surrogate(ratio, advantages, settings.clip_low, settings.clip_high)
    with torch.no_grad():
        log_ratio = importance_log_ratios(current.detach() if proximal is None else proximal, behaviour)
        weights, corrected = correction_weights(log_ratio, mask, settings)
    if settings.off_policy_correction != "none":
        surrogate = surrogate * weights
    normaliser = size.normaliser(settings.aggregation)
    loss = aggregate_sum(surrogate, mask, settings.aggregation) / normaliser
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * aggregate_sum(entropy, mask, settings.aggregation) / normaliser
    reference_kl = None
    if reference is not None:
        # Measured whenever a reference is given; a graph only when it is in the loss.
        with torch.set_grad_enabled(settings.kl_coef > 0 and torch.is_grad_enabled()):
            reference_kl = kl_estimate(reference - current, settings.kl_estimator)
        if settings.kl_coef > 0:
            loss = loss + settings.kl_coef * aggregate_sum(reference_kl, mask, settings.aggregation) / normaliser

    with torch.no_grad():
        def per_row(values: torch.Tensor | None) -> torch.Tensor:
            return torch.zeros_like(mask[:, 0]) if values is None else (values.detach() * mask).sum(-1)

        outside = (ratio < 1 - settings.clip_low) | (ratio > 1 + settings.clip_high)
        is_ratio = log_ratio.exp()
        statistics = TokenStatistics(
            tokens=mask.sum(-1), clipped=per_row(outside.to(mask.dtype)), is_ratio_sum=per_row(is_ratio),
            is_ratio_max=is_ratio.masked_fill(mask == 0, 0.0).amax(-1),
            corrected=per_row(corrected.to(mask.dtype)), behaviour_kl_sum=per_row(kl_estimate(log_ratio, "k3")),
            reference_kl_sum=per_row(reference_kl), entropy_sum=per_row(entropy),
        )
    return PolicyLoss(loss=loss, statistics=statistics)
