"""The trainer's step trains the configured loss (scd.training.loss): at the defaults the loss scd trained
before the options existed, bit for bit, updated weights included; each option changes the step's loss as
defined, on a fixed batch through ``GRPOTrainer``."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch
from prometheus_client import REGISTRY

from scd.config import Config, parse_config
from scd.errors import ConfigError
from scd.model.policy import build_policy
from scd.records import Rollout
from scd.schema import RunIdentity
from scd.telemetry.trackers import point_of
from scd.training.grpo import GRPOTrainer, padded_rows
from tests.test_loss import todays_advantages, todays_loss

MAX_NEW_TOKENS = 12


def config_for(tmp_path: Path, entropy_coef: float = 0.0, **loss: object) -> Config:
    return parse_config({"run": {"output_dir": str(tmp_path)}, "generation": {"max_new_tokens": MAX_NEW_TOKENS},
                         "trainer": {"lr": 1e-2, "entropy_coef": entropy_coef, "loss": loss}}, tmp_path)


def trainer_for(config: Config) -> GRPOTrainer:
    return GRPOTrainer(config, build_policy(config.model, config.run.seed))


def fixed_batch(trainer: GRPOTrainer, seed: int) -> list[list[Rollout]]:
    """Three groups of four completions of 2 to 12 tokens, rewards that differ within each group, and
    behaviour logprobs the trainer's own plus noise, so that some ratios leave every clip and cap; the rows
    of weight versions 0 and 1."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.head.weight.shape[0]
    groups = []
    for g in range(3):
        group = []
        for r in range(4):
            prompt, completion = 3 + r, 2 + (5 * g + 3 * r) % (MAX_NEW_TOKENS - 1)
            ids = torch.randint(4, vocab, (prompt + completion,), generator=generator)
            mask = torch.zeros(1, len(ids) - 1)
            mask[0, prompt - 1:] = 1.0
            with torch.no_grad():
                own, _ = trainer.completion_token_logprobs(ids[None], mask)
            noise = torch.randn(completion, generator=generator) * 0.6
            group.append(Rollout(ids, own[0, prompt - 1:] + noise, prompt,
                                 reward=float(torch.rand((), generator=generator)), weight_version=r % 2))
        groups.append(group)
    return groups


def reference_step(trainer: GRPOTrainer, groups: list[list[Rollout]]) -> float:
    """GRPOTrainer.train_share's step before [trainer.loss] existed (commit 449c03a), copied: PPO-clip against
    the engine's logprobs, a token mean over the step, std-normalised advantages."""
    cfg = trainer.cfg
    tokens, old_logp, mask = padded_rows([r for g in groups for r in g], trainer.policy.pad_id)
    trainer.model.train()
    with trainer.computing():
        new_logp, token_entropy = trainer.completion_token_logprobs(tokens, mask)
    loss, _, _ = todays_loss(new_logp, old_logp, mask, todays_advantages(groups, cfg.advantage_eps), token_entropy,
                             cfg.entropy_coef, sum(len(r.logprobs) for g in groups for r in g))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_default_step_is_todays_step_bit_for_bit_loss_and_weights(tmp_path: Path, entropy_coef: float) -> None:
    config = config_for(tmp_path, entropy_coef)
    ours, reference = trainer_for(config), trainer_for(config)
    for p, q in zip(ours.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(p, q)
    for step in range(2):  # the second on the optimizer state of the first
        groups = fixed_batch(reference, step)
        result = ours.step(groups, weight_version=1)
        assert result.loss == reference_step(reference, groups)
        for (name, p), q in zip(ours.model.named_parameters(), reference.model.parameters(), strict=True):
            assert torch.equal(p, q), name


def expected_loss(trainer: GRPOTrainer, groups: list[list[Rollout]], clip_high: float = 0.2, tis: bool = False,
                  sum_norm: bool = False, normalize_std: bool = True) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The step's loss by hand from the trainer's logprobs before the step, and the ratio and mask it used."""
    rows = [r for g in groups for r in g]
    tokens, behaviour, mask = padded_rows(rows, trainer.policy.pad_id)
    with torch.no_grad():
        current, _ = trainer.completion_token_logprobs(tokens, mask)
    eps = trainer.cfg.advantage_eps
    advantages = torch.cat([
        (rewards - rewards.mean()) / (rewards.std() + eps) if normalize_std else rewards - rewards.mean()
        for rewards in (torch.tensor([r.reward for r in g]) for g in groups)]).unsqueeze(1)
    ratio = torch.exp(current - behaviour)
    if tis:  # the clip's ratio is current ÷ proximal = 1; each token weighted min(r, is_cap = 2)
        token_loss = -advantages * ratio.clamp(max=2.0)
    else:
        token_loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1 + clip_high) * advantages)
    normaliser = len(rows) * MAX_NEW_TOKENS if sum_norm else mask.sum()
    return float((token_loss * mask).sum() / normaliser), ratio, mask


@pytest.mark.parametrize(("loss", "expected"), [
    ({"off_policy_correction": "tis"}, {"tis": True}),
    ({"clip_high": 0.28}, {"clip_high": 0.28}),
    ({"aggregation": "seq_mean_token_sum_norm"}, {"sum_norm": True}),
    ({"normalize_advantage_std": False}, {"normalize_std": False}),
])
def test_each_loss_option_changes_the_steps_loss_as_defined(tmp_path: Path, loss: dict[str, object],
                                                             expected: dict[str, object]) -> None:
    trainer = trainer_for(config_for(tmp_path, **loss))
    groups = fixed_batch(trainer, 0)
    value, _, _ = expected_loss(trainer, groups, **expected)
    default, _, _ = expected_loss(trainer, groups)
    assert trainer.step(groups, weight_version=1).loss == pytest.approx(value, rel=1e-5, abs=1e-7)
    assert value != pytest.approx(default, rel=1e-3)


def test_the_importance_ratios_and_behaviour_kl_by_staleness_reach_the_result_the_gauges_and_the_event(
        tmp_path: Path) -> None:
    trainer = trainer_for(config_for(tmp_path, off_policy_correction="tis"))
    groups = fixed_batch(trainer, 0)
    _, ratio, mask = expected_loss(trainer, groups, tis=True)
    # Trained at weight version 1: rows of version 1 are 0 versions stale, of version 0 one.
    lags = torch.tensor([1 - r.weight_version for g in groups for r in g])
    result = trainer.step(groups, weight_version=1)
    assert sorted(result.is_ratio) == [0, 1]
    stats = result.is_ratio_stats()
    event = result.event_fields()["is_ratio"]
    assert event == {f"{lag}/{stat}": value for lag in ("0", "1") for stat, value in stats[lag].items()}
    # What the trackers get of the train_step event: its numbers, a mapping's one level down.
    point = point_of(orjson.loads(orjson.dumps({"event": "train_step", "step": 3, "time": 1.0,
                                                 **result.event_fields()})), RunIdentity(run_id="r", started_at=0.0))
    assert point.scalars["train/is_ratio/1/max"] == stats["1"]["max"]
    assert point.scalars["train/behaviour_kl/0"] == result.behaviour_kl()["0"]
    assert point.scalars["train/lr"] == result.lr == trainer.cfg.lr == REGISTRY.get_sample_value("scd_train_lr")
    for lag in (0, 1):
        tokens = mask[lags == lag].bool()
        ratios = ratio[lags == lag][tokens]
        want = {"mean": float(ratios.mean()), "max": float(ratios.max()),
                "clipped_share": float((ratios > 2).float().mean())}
        # k3 of KL(behaviour ‖ proximal): r - 1 - log r per token.
        kl = float((ratios - 1 - ratios.log()).mean())
        assert result.behaviour_kl()[str(lag)] == pytest.approx(kl, rel=1e-4)
        assert REGISTRY.get_sample_value("scd_train_behaviour_kl", {"staleness": str(lag)}) == \
            result.behaviour_kl()[str(lag)]
        assert 0 < want["clipped_share"] < 1
        for stat, value in want.items():
            assert stats[str(lag)][stat] == pytest.approx(value, rel=1e-5), (lag, stat)
            assert REGISTRY.get_sample_value("scd_train_is_ratio", {"staleness": str(lag), "stat": stat}) == \
                stats[str(lag)][stat]
    # A step of fresh rows only: the lag it had none of leaves the gauge, not kept at the older step's value.
    fresh = [[Rollout(r.input_ids, r.logprobs, r.prompt_len, r.reward, weight_version=1) for r in g] for g in groups]
    trainer.step(fresh, weight_version=1)
    assert REGISTRY.get_sample_value("scd_train_is_ratio", {"staleness": "1", "stat": "mean"}) is None
    assert REGISTRY.get_sample_value("scd_train_is_ratio", {"staleness": "0", "stat": "mean"}) > 0


def hand_driven_mini_batch_steps(trainer: GRPOTrainer, halves: list[list[list[Rollout]]]) -> list[float]:
    """PPO-clip by hand, one optimizer step per half: the proximal logprobs of both halves taken before the
    first update, each half's loss a token mean over its own tokens."""
    cfg = trainer.cfg
    batches = [padded_rows([r for g in half for r in g], trainer.policy.pad_id) for half in halves]
    with torch.no_grad():
        proximal = [trainer.completion_token_logprobs(tokens, mask)[0] for tokens, _, mask in batches]
    losses = []
    for half, (tokens, _, mask), before in zip(halves, batches, proximal, strict=True):
        advantages = todays_advantages(half, cfg.advantage_eps).unsqueeze(1)
        current, _ = trainer.completion_token_logprobs(tokens, mask)
        ratio = torch.exp(current - before)
        token_loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        loss = (token_loss * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_two_mini_batches_are_two_optimizer_steps_on_the_halves_clipped_against_the_pre_step_policy(
        tmp_path: Path) -> None:
    config = parse_config({"run": {"output_dir": str(tmp_path)}, "generation": {"max_new_tokens": MAX_NEW_TOKENS},
                           "trainer": {"lr": 1e-2, "groups_per_step": 4, "mini_batches": 2}}, tmp_path)
    ours, by_hand, one_step = trainer_for(config), trainer_for(config), trainer_for(config_for(tmp_path))
    groups = fixed_batch(by_hand, 0) + fixed_batch(by_hand, 1)[:1]
    result = ours.step(groups, weight_version=1)
    one_step.step(groups, weight_version=1)
    losses = hand_driven_mini_batch_steps(by_hand, [groups[:2], groups[2:]])
    # The step's loss is the mean of its mini-batches' losses, each a step of its own.
    assert result.loss == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert result.tokens == sum(len(r.logprobs) for g in groups for r in g)
    # Both optimizer steps at the train step's rate, and its weights are two steps', not one.
    assert result.lr == config.trainer.lr
    moved = False
    for (name, p), q, once in zip(ours.model.named_parameters(), by_hand.model.parameters(),
                                  one_step.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        moved = moved or not torch.allclose(p, once, rtol=1e-4, atol=1e-6)
    assert moved


@pytest.mark.parametrize(("mini_batches", "correction", "forwards"), [
    (1, "none", 1),  # today's step: the proximal logprobs are the current ones detached, or not needed
    (1, "tis", 1),
    (2, "none", 3),  # the second mini-batch's proximal pass before the first update, then one forward each
    (2, "tis", 3),
    (4, "none", 7),
])
def test_the_proximal_pass_runs_only_for_later_mini_batches(tmp_path: Path, mini_batches: int, correction: str,
                                                            forwards: int) -> None:
    config = parse_config({"run": {"output_dir": str(tmp_path)}, "generation": {"max_new_tokens": MAX_NEW_TOKENS},
                           "trainer": {"groups_per_step": 4, "mini_batches": mini_batches,
                                       "loss": {"off_policy_correction": correction}}}, tmp_path)
    trainer = trainer_for(config)
    groups = fixed_batch(trainer, 0) + fixed_batch(trainer, 1)[:1]
    calls: list[int] = []
    trainer.policy.decoder_layers(trainer.model)[0].register_forward_hook(lambda *_: calls.append(1))
    trainer.step(groups, weight_version=1)
    assert len(calls) == forwards


@pytest.mark.parametrize(("trainer", "culprit"), [
    ({"groups_per_step": 16, "mini_batches": 3}, "divide trainer.groups_per_step = 16"),
    ({"mini_batches": 0}, "must be >= 1"),
    ({"groups_per_step": 4, "mini_batches": 4, "world_size": 2}, "trainer.world_size = 2 ranks"),
])
def test_mini_batches_must_split_the_step_into_whole_groups_for_every_rank(
        tmp_path: Path, trainer: dict[str, object], culprit: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.mini_batches") as raised:
        parse_config({"run": {"output_dir": str(tmp_path)}, "trainer": trainer}, tmp_path)
    assert culprit in str(raised.value)


def test_a_changed_mini_batches_is_a_training_change(tmp_path: Path) -> None:
    config = parse_config({"run": {"output_dir": str(tmp_path)}, "trainer": {"mini_batches": 2}}, tmp_path)
    assert config.training_settings()["trainer.mini_batches"] == 2
    assert config.training_changes(Config().training_settings()) == {"trainer.mini_batches": (1, 2)}
