"""A train step whose loss or gradient norm is not finite takes no optimizer step: the weights stay, the
step is counted by reason, and ``trainer.max_skipped_steps`` of them in a row stop the run (exit 1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from scd.errors import EXIT_OTHER
from scd.records import Rollout
from scd.training.grpo import GRPOTrainer, NonFiniteSteps
from tests.test_trainer_loss import config_for, fixed_batch, trainer_for


def skipped_total(reason: str) -> float:
    return REGISTRY.get_sample_value("scd_train_steps_skipped_total", {"reason": reason}) or 0.0


def with_nan_logprob(groups: list[list[Rollout]]) -> list[list[Rollout]]:
    """The batch with one behaviour logprob NaN (an engine that returned one)."""
    first = groups[0][0]
    logprobs = first.logprobs.clone()
    logprobs[0] = math.nan
    return [[Rollout(first.input_ids, logprobs, first.prompt_len, first.reward, first.weight_version),
             *groups[0][1:]], *groups[1:]]


def weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def assert_unchanged(trainer: GRPOTrainer, before: dict[str, torch.Tensor]) -> None:
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_non_finite_loss_or_grad_norm_skips_the_optimizer_step_and_is_counted(tmp_path: Path) -> None:
    trainer = trainer_for(config_for(tmp_path))
    groups = fixed_batch(trainer, 0)
    before, counted = weights(trainer), skipped_total("loss")
    result = trainer.step(with_nan_logprob(groups), weight_version=0)
    assert result.skipped == "loss" and math.isnan(result.loss)
    assert_unchanged(trainer, before)
    assert not trainer.optimizer.state  # no Adam moment took the NaN either
    assert skipped_total("loss") == counted + 1
    assert all(p.grad is None for p in trainer.model.parameters())

    # A finite loss whose gradient is not: one parameter's gradient made infinite.
    parameter = next(trainer.model.parameters())
    hook = parameter.register_hook(lambda grad: grad * math.inf)
    counted = skipped_total("grad_norm")
    assert trainer.step(groups, weight_version=0).skipped == "grad_norm"
    assert_unchanged(trainer, before)
    assert skipped_total("grad_norm") == counted + 1
    hook.remove()
    # The next good step trains: the skipped ones left nothing behind.
    assert trainer.step(groups, weight_version=0).skipped is None
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


def test_max_skipped_steps_in_a_row_stop_the_run_with_exit_1_naming_it(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    config.trainer.max_skipped_steps = 2
    trainer = trainer_for(config)
    groups = fixed_batch(trainer, 0)
    bad = with_nan_logprob(groups)
    trainer.step(bad, weight_version=0)
    trainer.step(groups, weight_version=0)  # a good step between: the count starts again
    trainer.step(bad, weight_version=1)
    before = weights(trainer)
    with pytest.raises(NonFiniteSteps, match=r"trainer\.max_skipped_steps = 2") as caught:
        trainer.step(bad, weight_version=1)
    assert caught.value.exit_code == EXIT_OTHER
    assert_unchanged(trainer, before)
