"""The learning-rate schedule in the trainer: each optimizer step trains at ``trainer.lr`` times lr_factor of
the steps taken, and a bundle's restore goes on with the schedule where it left it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scd.config import Config, parse_config
from scd.training.grpo import GRPOTrainer
from scd.training.schedule import lr_factor
from tests.test_trainer_loss import fixed_batch, trainer_for

STEPS, RESTORED_AT = 6, 3


def cosine_config(tmp_path: Path, lr: float = 1e-2) -> Config:
    return parse_config({"run": {"output_dir": str(tmp_path), "max_steps": STEPS},
                         "trainer": {"lr": lr, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}},
                        tmp_path)


def recording(trainer: GRPOTrainer) -> list[float]:
    """The rate of each optimizer step the trainer takes from now on, as the optimizer sees it."""
    rates: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, *_: rates.append(optimizer.param_groups[0]["lr"]))
    return rates


def test_a_cosine_schedule_trains_each_step_at_its_factor_and_a_restore_goes_on_with_it(tmp_path: Path) -> None:
    config = cosine_config(tmp_path)
    batches = [fixed_batch(trainer_for(config), step) for step in range(STEPS)]
    ran = trainer_for(config)
    rates = recording(ran)
    for step in range(RESTORED_AT):
        ran.step(batches[step], weight_version=step)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    ran.capture_state().write(bundle / "model.pt", bundle / "optimizer.pt")
    for step in range(RESTORED_AT, STEPS):
        ran.step(batches[step], weight_version=step)
    assert rates == pytest.approx([1e-2 * lr_factor(step, total_steps=STEPS, schedule="cosine", warmup_steps=2,
                                                    min_lr_ratio=0.1) for step in range(STEPS)], rel=1e-12)
    # Warmup 1/2, 2/2, then the cosine from 1 down towards 0.1: the schedule is in the rates, not a constant.
    assert rates[0] == pytest.approx(5e-3) and rates[2] == pytest.approx(1e-2) and rates[-1] < 0.3e-2

    restored = trainer_for(config)
    assert restored.load_state_files(bundle / "model.pt", bundle / "optimizer.pt") == {}
    restored_rates = recording(restored)
    for step in range(RESTORED_AT, STEPS):
        restored.step(batches[step], weight_version=step)
    assert restored_rates == rates[RESTORED_AT:]
    for (name, p), q in zip(ran.model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(p, q), name

    # A changed trainer.lr is the base's change, old -> new, and the schedule scales the new one; a bundle from
    # before schedules (no base in its optimizer state, its rate constant) compares its own rate.
    doubled = trainer_for(cosine_config(tmp_path, lr=2e-2))
    assert doubled.load_state_files(bundle / "model.pt", bundle / "optimizer.pt") == {"trainer.lr": [1e-2, 2e-2]}
    doubled_rates = recording(doubled)
    doubled.step(batches[RESTORED_AT], weight_version=RESTORED_AT)
    assert doubled_rates == [pytest.approx(2 * rates[RESTORED_AT], rel=1e-12)]
    optimizer = torch.load(bundle / "optimizer.pt", weights_only=True)
    for group in optimizer["param_groups"]:
        group["lr"] = group.pop("initial_lr")
    constant = trainer_for(parse_config({"run": {"output_dir": str(tmp_path)}, "trainer": {"lr": 1e-2}}, tmp_path))
    assert constant.load_state(torch.load(bundle / "model.pt", weights_only=True), optimizer) == {}
