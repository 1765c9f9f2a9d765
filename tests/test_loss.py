"""The loss options, each against a hand-computed reference on tiny tensors (value and gradient), and the
default settings against the loss scd trained with before they existed, bit for bit."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from scd.errors import ConfigError
from scd.records import Rollout
from scd.training.loss import (
    LossSettings,
    StepSize,
    aggregate_sum,
    correction_weights,
    group_advantages,
    importance_log_ratios,
    kl_estimate,
    policy_loss,
    step_advantages,
)
from scd.training.schedule import lr_factor

# Two completions of 3 and 2 tokens; the third position of the second is padding.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
BEHAVIOUR = torch.full((2, 3), -1.0)


def logprobs_at(ratios: list[list[float]]) -> torch.Tensor:
    """Logprobs whose ratio to ``BEHAVIOUR`` is ``ratios`` (1 at padding)."""
    return BEHAVIOUR + torch.log(torch.tensor([row + [1.0] * (3 - len(row)) for row in ratios]))


def leaf(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


def by_token(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (3 - len(row)) for row in values])


def size(tokens: int = 5, sequences: int = 2, budget: int = 4) -> StepSize:
    return StepSize(tokens=tokens, sequences=sequences, max_completion_tokens=budget)


def loss_and_grad(settings: LossSettings, current: torch.Tensor, advantages: list[float], step: StepSize | None = None,
                  **kwargs: torch.Tensor) -> tuple[float, torch.Tensor, object]:
    current = leaf(current)
    out = policy_loss(current, BEHAVIOUR, torch.tensor(advantages), MASK, step or size(), settings, **kwargs)
    out.loss.backward()
    return float(out.loss.detach()), current.grad, out.statistics


def test_the_defaults_are_the_documented_table() -> None:
    table = msgspec.toml.decode(b"""
clip_low = 0.2
clip_high = 0.2
aggregation = "token_mean"
normalize_advantage_std = true
off_policy_correction = "none"
is_cap = 2.0
is_low = 0.5
is_high = 2.0
kl_coef = 0.0
kl_estimator = "k3"
mask_truncated = false
""", type=LossSettings)
    assert table == LossSettings()
    LossSettings().check()
    with pytest.raises(msgspec.ValidationError, match="clip_hihg"):
        msgspec.convert({"clip_hihg": 0.28}, LossSettings)
    with pytest.raises(msgspec.ValidationError, match="aggregation"):
        msgspec.convert({"aggregation": "mean"}, LossSettings)


@pytest.mark.parametrize(("key", "value"), [
    ("clip_low", 1.0), ("clip_low", 0.0), ("clip_high", 0.0), ("is_cap", 0.9), ("is_low", 0.0), ("is_low", 1.1),
    ("is_high", 0.9), ("kl_coef", -0.1),
])
def test_a_setting_that_makes_no_loss_is_refused_naming_its_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"trainer\.loss\.{key}'"):
        msgspec.structs.replace(LossSettings(), **{key: value}).check()


def test_advantages_are_group_normalised_and_dr_grpo_leaves_out_the_std() -> None:
    rewards = torch.tensor([3.0, 1.0, 2.0])  # mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1
    assert torch.allclose(group_advantages(rewards, 0.1), torch.tensor([1 / 1.1, -1 / 1.1, 0.0]))
    assert torch.equal(group_advantages(rewards, 0.1, normalize_std=False), torch.tensor([1.0, -1.0, 0.0]))
    half = math.sqrt(0.5)  # [1, 0]: mean 0.5, std sqrt(0.5)
    assert torch.allclose(step_advantages([[3.0, 1.0, 2.0], [1.0, 0.0]], 0.0),
                          torch.tensor([1.0, -1.0, 0.0, 0.5 / half, -0.5 / half]))


# current ÷ behaviour (no proximal: the clip anchors to behaviour), advantages +1 and -1.
CLIP_RATIOS = [[1.1, 1.25, 0.5], [1.5, 0.5]]


def test_the_clip_keeps_a_token_that_left_the_range_on_its_advantages_side_out_of_the_gradient() -> None:
    # -min(rA, clip(r)A), clip to [0.8, 1.2]: +1.1 -> -1.1; 1.25 -> -1.2 (clipped, no gradient); 0.5 -> -0.5
    # (below the range, pushed up: kept); -1 x 1.5 -> 1.5 (kept); -1 x 0.5 -> 0.8 (clipped).  Gradient of a kept
    # token's -rA by its logprob is -rA.
    value, grad, stats = loss_and_grad(LossSettings(), logprobs_at(CLIP_RATIOS), [1.0, -1.0])
    assert value == pytest.approx((-1.1 - 1.2 - 0.5 + 1.5 + 0.8) / 5)
    assert torch.allclose(grad, by_token([[-1.1, 0.0, -0.5], [1.5, 0.0]]) / 5)
    assert stats.sums().clipped == 4 and stats.sums().tokens == 5


def test_clip_higher_lets_an_unlikely_token_grow_further() -> None:
    # clip_high 0.28: 1.25 is inside [0.8, 1.28], so its -1.25 and its gradient count.
    value, grad, stats = loss_and_grad(LossSettings(clip_high=0.28), logprobs_at(CLIP_RATIOS), [1.0, -1.0])
    assert value == pytest.approx((-1.1 - 1.25 - 0.5 + 1.5 + 0.8) / 5)
    assert torch.allclose(grad, by_token([[-1.1, -1.25, -0.5], [1.5, 0.0]]) / 5)
    assert stats.sums().clipped == 3


@pytest.mark.parametrize(("aggregation", "value", "scale"), [
    # Token losses: row 0 [-1.1, -1.2, -0.5] (sum -2.8, 3 tokens), row 1 [1.5, 0.8] (sum 2.3, 2 tokens).
    ("token_mean", (-2.8 + 2.3) / 5, [[1 / 5] * 3, [1 / 5] * 2]),
    ("seq_mean_token_mean", (-2.8 / 3 + 2.3 / 2) / 2, [[1 / 6] * 3, [1 / 4] * 2]),
    ("seq_mean_token_sum_norm", (-2.8 + 2.3) / (2 * 4), [[1 / 8] * 3, [1 / 8] * 2]),
])
def test_each_aggregation_divides_by_its_own_normaliser(aggregation: str, value: float,
                                                        scale: list[list[float]]) -> None:
    settings = LossSettings(aggregation=aggregation)
    got, grad, _ = loss_and_grad(settings, logprobs_at(CLIP_RATIOS), [1.0, -1.0])
    assert got == pytest.approx(value)
    assert torch.allclose(grad, by_token([[-1.1, 0.0, -0.5], [1.5, 0.0]]) * by_token(scale))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("correction", ["none", "tis", "mis", "icepop", "seq_tis", "seq_mask_tis"])
def test_rows_split_over_ranks_add_up_to_the_whole_steps_loss_and_gradient(aggregation: str, correction: str) -> None:
    settings = LossSettings(aggregation=aggregation, off_policy_correction=correction, kl_coef=0.1)
    current = logprobs_at([[1.1, 1.25, 0.5], [1.5, 0.5]])
    proximal = logprobs_at([[1.5, 3.0, 0.4], [2.5, 1.2]])
    reference = logprobs_at([[0.7, 1.0, 1.3], [0.9, 2.0]])
    step = size()

    def run(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        mine = leaf(current[rows])
        out = policy_loss(mine, BEHAVIOUR[rows], torch.tensor([1.0, -0.5])[rows], MASK[rows], step, settings,
                          proximal=proximal[rows], reference=reference[rows])
        out.loss.backward()
        return out.loss.detach(), mine.grad

    whole_loss, whole_grad = run(slice(0, 2))
    first_loss, first_grad = run(slice(0, 1))
    second_loss, second_grad = run(slice(1, 2))
    assert torch.allclose(first_loss + second_loss, whole_loss)
    assert torch.allclose(torch.cat([first_grad, second_grad]), whole_grad)


# proximal ÷ behaviour; the current logprobs equal the proximal (one optimizer step: the clip ratio is 1), so a
# token's loss is -A·w and its gradient -A·w too (d(-A·w·r)/dlogp = -A·w·r, r = 1).
IS_RATIOS = [[1.5, 3.0, 0.4], [2.5, 1.2]]


@pytest.mark.parametrize(("correction", "extra", "token_losses", "corrected"), [
    # min(r, 2): [1.5, 2, 0.4], [2, 1.2]; advantages +1 and -0.5.
    ("tis", {}, [[-1.5, -2.0, -0.4], [1.0, 0.6]], 2),
    # 1 inside [0.5, 2], else 0: [1, 0, 0], [0, 1].
    ("mis", {}, [[-1.0, 0.0, 0.0], [0.0, 0.5]], 3),
    # r inside [0.5, 2], else 0: [1.5, 0, 0], [0, 1.2].
    ("icepop", {}, [[-1.5, 0.0, 0.0], [0.0, 0.6]], 3),
    # Products 1.5·3·0.4 = 1.8 (under the cap) and 2.5·1.2 = 3 (capped to 2), on every token of the row.
    ("seq_tis", {}, [[-1.8, -1.8, -1.8], [1.0, 1.0]], 2),
    # Geometric means 1.8^(1/3) ≈ 1.216 (inside [0.5, 1.5]: tokens weighted by their own r) and √3 ≈ 1.732
    # (outside: the whole row is masked).
    ("seq_mask_tis", {"is_high": 1.5}, [[-1.5, -3.0, -0.4], [0.0, 0.0]], 2),
])
def test_each_off_policy_correction_weights_tokens_by_proximal_over_behaviour(
        correction: str, extra: dict[str, float], token_losses: list[list[float]], corrected: int) -> None:
    settings = LossSettings(off_policy_correction=correction, **extra)
    proximal = logprobs_at(IS_RATIOS)
    value, grad, stats = loss_and_grad(settings, proximal, [1.0, -0.5], proximal=proximal)
    expected = by_token(token_losses)
    assert value == pytest.approx(float(expected.sum()) / 5)
    assert torch.allclose(grad, expected / 5)
    sums = stats.sums()
    assert sums.corrected == corrected
    assert sums.is_ratio_sum == pytest.approx(1.5 + 3.0 + 0.4 + 2.5 + 1.2)
    assert sums.is_ratio_max == pytest.approx(3.0)
    # k3 of KL(behaviour ‖ proximal): r - 1 - log r per token.
    assert sums.behaviour_kl_sum == pytest.approx(sum(r - 1 - math.log(r) for row in IS_RATIOS for r in row))
    assert stats.sums(torch.tensor([False, True])).is_ratio_max == pytest.approx(2.5)


def test_a_correction_needs_the_proximal_logprobs_and_the_clip_anchors_to_them() -> None:
    with pytest.raises(ValueError, match="proximal"):
        loss_and_grad(LossSettings(off_policy_correction="tis"), BEHAVIOUR, [1.0, -1.0])
    # Rollouts 3x likelier under the weights the step starts from than under the engine's: against behaviour
    # the clip stops the gradient (ratio 3 > 1.2 with A > 0); against the proximal the ratio is 1 and it flows.
    stale = logprobs_at([[3.0, 3.0, 3.0], [3.0, 3.0]])
    _, bypass_grad, _ = loss_and_grad(LossSettings(), stale, [1.0, 1.0])
    _, grad, _ = loss_and_grad(LossSettings(), stale, [1.0, 1.0], proximal=stale)
    assert torch.equal(bypass_grad, torch.zeros(2, 3))
    assert torch.allclose(grad, -MASK / 5)


def test_log_ratios_are_bounded_so_no_weight_is_infinite_and_a_masked_token_stays_finite() -> None:
    proximal = torch.tensor([[-1.0, -float("inf"), -1.0]])
    behaviour = torch.tensor([[-100.0, -1.0, -1.0]])
    log_ratio = importance_log_ratios(proximal, behaviour)
    assert torch.equal(log_ratio, torch.tensor([[20.0, -20.0, 0.0]]))
    weights, corrected = correction_weights(log_ratio, torch.ones(1, 3), LossSettings(off_policy_correction="icepop"))
    assert torch.isfinite(weights).all() and torch.equal(corrected, torch.tensor([[True, True, False]]))


@pytest.mark.parametrize(("estimator", "token_kl", "token_grad"), [
    # log_ratio = log(reference ÷ current) = [log 2, -log 2] at two tokens of one row.
    ("k1", [-math.log(2), math.log(2)], [1.0, 1.0]),  # -x; d/dlogp = 1
    ("k2", [0.5 * math.log(2) ** 2] * 2, [-math.log(2), math.log(2)]),  # x²/2; d/dlogp = -x
    ("k3", [1 - math.log(2), math.log(2) - 0.5], [-1.0, 0.5]),  # e^x - 1 - x; d/dlogp = 1 - e^x
])
def test_reference_kl_estimators_match_schulmans_and_enter_the_loss_times_kl_coef(
        estimator: str, token_kl: list[float], token_grad: list[float]) -> None:
    current = leaf(torch.tensor([[-1.0, -1.0]]))
    reference = current.detach() + torch.tensor([[math.log(2), -math.log(2)]])
    assert torch.allclose(kl_estimate(reference - current.detach(), estimator), torch.tensor([token_kl]))
    settings = LossSettings(kl_coef=0.5, kl_estimator=estimator)
    # A zero advantage: the KL term alone.
    out = policy_loss(current, current.detach(), torch.tensor([0.0]), torch.ones(1, 2), size(tokens=2, sequences=1),
                      settings, reference=reference)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(0.5 * sum(token_kl) / 2, abs=1e-7)
    assert torch.allclose(current.grad, 0.5 * torch.tensor([token_grad]) / 2)
    assert out.statistics.sums().reference_kl_sum == pytest.approx(sum(token_kl), abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(current, current.detach(), torch.tensor([0.0]), torch.ones(1, 2), size(), settings)
    # kl_coef 0: measured, not in the loss.
    measured = policy_loss(current, current.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                           size(tokens=2, sequences=1), LossSettings(kl_estimator=estimator), reference=reference)
    assert float(measured.loss.detach()) == 0.0
    assert measured.statistics.sums().reference_kl_sum == pytest.approx(sum(token_kl), abs=1e-6)


def test_a_truncated_completion_carries_no_loss_and_leaves_the_normaliser() -> None:
    settings = LossSettings(mask_truncated=True)
    step = StepSize.of([3, 2], [False, True], settings, max_completion_tokens=4)
    assert step == StepSize(tokens=3, sequences=1, max_completion_tokens=4)
    assert StepSize.of([3, 2], [False, True], LossSettings(), 4) == size()
    value, grad, stats = loss_and_grad(settings, logprobs_at(CLIP_RATIOS), [1.0, -1.0], step,
                                       truncated=torch.tensor([False, True]))
    assert value == pytest.approx((-1.1 - 1.2 - 0.5) / 3)
    assert torch.allclose(grad, by_token([[-1.1, 0.0, -0.5], [0.0, 0.0]]) / 3)
    assert stats.sums().tokens == 3
    with pytest.raises(ValueError, match="truncated"):
        loss_and_grad(settings, logprobs_at(CLIP_RATIOS), [1.0, -1.0], step)


def test_a_step_whose_every_completion_is_masked_has_loss_zero_not_nan() -> None:
    settings = LossSettings(mask_truncated=True)
    step = StepSize.of([3, 2], [True, True], settings, max_completion_tokens=4)
    value, grad, _ = loss_and_grad(settings, logprobs_at(CLIP_RATIOS), [1.0, -1.0], step,
                                   truncated=torch.tensor([True, True]))
    assert value == 0.0 and torch.equal(grad, torch.zeros(2, 3))


def test_aggregate_sum_of_a_sequence_mean_averages_each_rows_own_tokens() -> None:
    values = by_token([[3.0, 6.0, 9.0], [4.0, 8.0]])
    assert float(aggregate_sum(values, MASK, "seq_mean_token_mean")) == 6.0 + 6.0
    assert float(aggregate_sum(values, MASK, "token_mean")) == 30.0


def todays_rows(seed: int) -> tuple[list[list[Rollout]], int]:
    """Three groups of four completions of 1 to 9 tokens after prompts of 2 to 5, as the engine records them."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(3):
        group = []
        for _ in range(4):
            prompt = int(torch.randint(2, 6, (1,), generator=gen))
            completion = int(torch.randint(1, 10, (1,), generator=gen))
            group.append(Rollout(input_ids=torch.randint(3, 50, (prompt + completion,), generator=gen),
                                 logprobs=-torch.rand(completion, generator=gen) * 3, prompt_len=prompt,
                                 reward=float(torch.randint(0, 2, (1,), generator=gen)), weight_version=0))
        groups.append(group)
    return groups, sum(len(r.logprobs) for g in groups for r in g)


def todays_advantages(groups: list[list[Rollout]], advantage_eps: float) -> torch.Tensor:
    """The advantages GRPOTrainer.train_share computed before [trainer.loss] (commit 76647f9), copied."""
    return torch.cat([
        (lambda rewards: (rewards - rewards.mean()) / (rewards.std() + advantage_eps))(
            torch.tensor([r.reward for r in g])) for g in groups
    ])


def todays_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                token_entropy: torch.Tensor, entropy_coef: float, step_tokens: int,
                clip_eps: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss GRPOTrainer.train_share computed before [trainer.loss] (commit 76647f9), copied; with the
    ratio and the entropy sum."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    surrogate = -torch.minimum(ratio * adv, clipped * adv)
    loss = (surrogate * mask).sum() / step_tokens
    entropy_sum = (token_entropy * mask).sum()
    if entropy_coef:
        loss = loss - entropy_coef * entropy_sum / step_tokens
    return loss, ratio, entropy_sum


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_default_settings_are_todays_loss_bit_for_bit(entropy_coef: float, seed: int) -> None:
    groups, step_tokens = todays_rows(seed)
    clip_eps, advantage_eps = 0.2, 1e-4
    # The batch as GRPOTrainer.train_share builds it.
    rows = [row for group in groups for row in group]
    width = max(len(r.input_ids) for r in rows)
    old_logp = torch.zeros(len(rows), width - 1)
    mask = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        span = slice(r.prompt_len - 1, len(r.input_ids) - 1)
        old_logp[i, span] = r.logprobs
        mask[i, span] = 1.0
    gen = torch.Generator().manual_seed(100 + seed)
    # The trainer's logprobs: 0 outside the completions, near the engine's inside (some ratios leave the clip).
    new_values = (old_logp + torch.randn(old_logp.shape, generator=gen) * 0.3) * mask
    entropy_values = torch.rand(old_logp.shape, generator=gen) * mask

    advantages = todays_advantages(groups, advantage_eps)
    new_logp, token_entropy = leaf(new_values), leaf(entropy_values)
    loss, ratio, entropy_sum = todays_loss(new_logp, old_logp, mask, advantages, token_entropy, entropy_coef,
                                           step_tokens)
    loss.backward()
    clipped_tokens = (((ratio - 1).abs() > clip_eps).float() * mask).sum()

    settings = LossSettings()
    current, entropy = leaf(new_values), leaf(entropy_values)
    ours_advantages = step_advantages([[r.reward for r in g] for g in groups], advantage_eps,
                                      normalize_std=settings.normalize_advantage_std)
    size = StepSize.of([len(r.logprobs) for r in rows], [False] * len(rows), settings, max_completion_tokens=9)
    out = policy_loss(current, old_logp, ours_advantages, mask, size, settings, entropy=entropy,
                      entropy_coef=entropy_coef)
    out.loss.backward()

    assert torch.equal(ours_advantages, advantages)
    assert size.normaliser(settings.aggregation) == step_tokens
    assert torch.equal(out.loss, loss)
    assert torch.equal(current.grad, new_logp.grad)
    assert (entropy.grad is None) == (token_entropy.grad is None)
    assert entropy.grad is None or torch.equal(entropy.grad, token_entropy.grad)
    sums = out.statistics.sums()
    assert 0 < sums.clipped == float(clipped_tokens) < step_tokens
    assert sums.tokens == step_tokens
    assert sums.entropy_sum == pytest.approx(float(entropy_sum.detach()))


def test_warmup_rises_to_the_full_rate_without_a_step_at_zero() -> None:
    assert [lr_factor(s, total_steps=100, schedule="constant", warmup_steps=4) for s in range(6)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(("schedule", "warmup", "floor", "step", "factor"), [
    ("constant", 0, 0.0, 50, 1.0),
    ("linear", 0, 0.0, 0, 1.0), ("linear", 0, 0.0, 5, 0.5), ("linear", 0, 0.0, 10, 0.0), ("linear", 0, 0.0, 30, 0.0),
    # After 2 warmup steps the decay runs over 8: progress (step - 2) / 8.
    ("linear", 2, 0.2, 4, 0.2 + 0.8 * 0.75),
    ("cosine", 2, 0.1, 2, 1.0), ("cosine", 2, 0.1, 6, 0.1 + 0.9 * 0.5), ("cosine", 2, 0.1, 10, 0.1),
    ("cosine", 2, 0.1, 50, 0.1),
])
def test_schedules_decay_to_their_floor_and_stay_there(schedule: str, warmup: int, floor: float, step: int,
                                                        factor: float) -> None:
    assert lr_factor(step, total_steps=10, schedule=schedule, warmup_steps=warmup,
                     min_lr_ratio=floor) == pytest.approx(factor)
