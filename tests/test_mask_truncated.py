"""``trainer.loss.mask_truncated``: a completion that ended by length (generation.max_new_tokens, no EOS or stop
string) carries no loss.  Its flag comes from the backend's finish reason, is stored with its ready group
(``GroupMeta.truncated``) and read back with the group's TQ rows; a group of a bundle written before the flag
reads as not truncated and hashes as it did.  The trainer steps here are real torch on the tiny policy; the run
is the controller in-process on the session's real TQ (the synthetic engine)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from scd.checkpoint.verify import check_group
from scd.config import parse_config
from scd.daemon import Controller
from scd.generation.base import GroupRequest
from scd.generation.synthetic_backend import SyntheticBackend
from scd.model.policy import build_policy
from scd.records import Completion, FinishReason, Rollout
from scd.replay import GroupMeta, group_hash, rollouts_of
from scd.training.group import TrainerGroup
from scd.training.grpo import GRPOTrainer, padded_rows, step_size
from scd.training.loss import StepSize
from tests.conftest import tiny_config
from tests.test_trainer_group import GROUPS, assert_close, batch, weights_of
from tests.test_trainer_loss import MAX_NEW_TOKENS, config_for, fixed_batch, trainer_for


def test_the_flag_is_a_config_key_default_false_and_recorded_with_the_training_settings(tmp_path: Path) -> None:
    default = parse_config({}, tmp_path)
    assert default.trainer.loss.mask_truncated is False
    assert default.training_settings()["trainer.loss.mask_truncated"] is False
    masked = parse_config({"trainer": {"loss": {"mask_truncated": True}}}, tmp_path)
    assert masked.training_settings()["trainer.loss.mask_truncated"] is True
    assert masked.training_changes(default.training_settings()) == {"trainer.loss.mask_truncated": (False, True)}


async def test_the_synthetic_engine_reports_a_completion_at_its_budget_truncated_and_a_shorter_one_not(
        tmp_path: Path) -> None:
    config = parse_config({"generation": {"backend": "synthetic", "max_new_tokens": 4, "group_size": 16, "synthetic": {
        "tokens_per_s": 1e6, "min_completion_tokens": 1, "max_completion_tokens": 4}}}, tmp_path)
    backend = SyntheticBackend(config)
    request = GroupRequest("e0-p0", 0, 0, (5, 6, 7), tuple(range(16)), 4, None, 0.0)

    def ignore(request: GroupRequest, index: int, completion: Completion) -> None:
        return None

    # Lengths drawn from 1..4 by the engine's generator seeded from run.seed: the same 16 every run, both kinds.
    [result] = await backend.generate([request], ignore)
    for c in result.completions:
        assert c.truncated is (len(c.token_ids) == 4) is (c.finish_reason is FinishReason.LENGTH)
    assert {c.truncated for c in result.completions} == {True, False}


def truncating(groups: list[list[Rollout]], cut: set[int]) -> list[list[Rollout]]:
    """The groups with their rows at the step-wide positions ``cut`` marked as ended by length."""
    rows = iter(range(sum(map(len, groups))))
    return [[Rollout(r.input_ids, r.logprobs, r.prompt_len, r.reward, r.weight_version, truncated=next(rows) in cut)
             for r in g] for g in groups]


def test_truncated_rows_carry_no_loss_and_leave_the_normaliser(tmp_path: Path) -> None:
    trainer = trainer_for(config_for(tmp_path, mask_truncated=True))
    groups = truncating(fixed_batch(trainer, 0), cut={0, 5, 6, 11})
    rows = [r for g in groups for r in g]
    # By hand: today's PPO-clip per token, advantages over whole groups (truncated rows' rewards count), summed
    # over the kept rows' tokens and divided by their count.
    tokens, behaviour, mask = padded_rows(rows, trainer.policy.pad_id)
    with torch.no_grad():
        current, _ = trainer.completion_token_logprobs(tokens, mask)
    eps = trainer.cfg.advantage_eps
    advantages = torch.cat([(rw - rw.mean()) / (rw.std() + eps)
                            for rw in (torch.tensor([r.reward for r in g]) for g in groups)]).unsqueeze(1)
    ratio = torch.exp(current - behaviour)
    token_loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    kept = mask * torch.tensor([not r.truncated for r in rows]).unsqueeze(1)
    expected = float((token_loss * kept).sum() / kept.sum())
    unmasked = float((token_loss * mask).sum() / mask.sum())
    result = trainer.step(groups, weight_version=1)
    assert result.loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert expected != pytest.approx(unmasked, rel=1e-3)
    assert result.tokens == int(kept.sum()) < int(mask.sum())


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_a_step_whose_only_signal_is_in_truncated_rows_moves_no_weight_under_the_mask(
        tmp_path: Path, mask_truncated: bool) -> None:
    trainer = trainer_for(config_for(tmp_path, mask_truncated=mask_truncated))
    # Each group: two truncated rows of rewards 0 and 1, two finished ones at the group's mean (advantage 0).
    groups = [[Rollout(r.input_ids, r.logprobs, r.prompt_len, reward, r.weight_version, truncated=reward != 0.5)
               for r, reward in zip(g, (0.0, 1.0, 0.5, 0.5), strict=True)] for g in fixed_batch(trainer, 1)]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.step(groups, weight_version=1)
    moved = [not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True)]
    if mask_truncated:
        assert result.loss == 0.0 and not any(moved)
    else:
        assert result.loss != 0.0 and any(moved)


def test_the_step_size_leaves_out_truncated_rows_only_under_the_mask(tmp_path: Path) -> None:
    masked = config_for(tmp_path, mask_truncated=True)
    groups = truncating(fixed_batch(trainer_for(masked), 0), cut={1, 2})
    lengths = [len(r.logprobs) for g in groups for r in g]
    kept = [n for i, n in enumerate(lengths) if i not in {1, 2}]
    assert step_size(masked, groups) == StepSize(sum(kept), len(kept), MAX_NEW_TOKENS)
    assert step_size(config_for(tmp_path), groups) == StepSize(sum(lengths), len(lengths), MAX_NEW_TOKENS)


def group_meta(**fields: Any) -> GroupMeta:
    return GroupMeta(group_id="e0-p0", epoch=0, prompt_id=0, sample_ids=("e0-p0/0", "e0-p0/1"),
                     start_weight_version=0, end_weight_version=0, prompt_len=2, seq_lens=(4, 3), rewards=(1.0, 0.0),
                     weight_versions=(0, 0), **fields)


def test_a_group_recorded_before_the_flag_reads_as_not_truncated_and_hashes_as_it_did() -> None:
    recorded = group_meta(truncated=(True, False))
    # The sidecar JSON of a bundle written before the flag: the same group without the key.
    old_document = {k: v for k, v in msgspec.to_builtins(recorded).items() if k != "truncated"}
    old = msgspec.json.decode(msgspec.json.encode(old_document), type=GroupMeta)
    assert old.truncated == ()
    # The replay digest that bundle recorded is over each group's canonical JSON as it was then.
    assert group_hash(old) == hashlib.sha256(msgspec.json.encode(old_document, order="sorted")).digest()
    assert group_hash(recorded) != group_hash(old)
    ids, logprobs = [torch.arange(4), torch.arange(3)], [torch.zeros(2), torch.zeros(1)]
    assert [r.truncated for r in rollouts_of(old, ids, logprobs)] == [False, False]
    assert [r.truncated for r in rollouts_of(recorded, ids, logprobs)] == [True, False]
    assert check_group(old, 2) == check_group(recorded, 2) == ""
    assert "1 truncated flags" in check_group(group_meta(truncated=(True,)), 2)


async def test_a_run_trains_the_backends_flags_through_tq_and_masks_those_rows(tmp_path: Path, partition: str) -> None:
    """The synthetic engine ends a completion at its budget by length, a shorter one as at EOS; every row the
    trainer gets carries that flag from its group's TQ rows, and under the mask its tokens are not trained."""
    max_new_tokens = 4
    config = tiny_config(tmp_path, partition, generation={
        "backend": "synthetic", "max_new_tokens": max_new_tokens,
        "synthetic": {"tokens_per_s": 20_000.0, "min_completion_tokens": 1, "max_completion_tokens": max_new_tokens}},
        trainer={"loss": {"mask_truncated": True}})
    trained: list[tuple[list[list[Rollout]], int]] = []
    async with Controller.open(config, config_dir=tmp_path) as controller:
        step = controller.trainer.step

        def recording(groups: list[list[Rollout]], weight_version: int) -> Any:
            result = step(groups, weight_version)
            trained.append((groups, result.tokens))
            return result

        controller.trainer.step = recording  # type: ignore[method-assign]
        await controller.run(max_steps=3)
        await controller.dataplane.clear_all()
    rows = [r for groups, _ in trained for g in groups for r in g]
    assert len(trained) == 3
    assert all(r.truncated is (len(r.logprobs) == max_new_tokens) for r in rows)
    assert {r.truncated for r in rows} == {True, False}
    for groups, tokens in trained:
        assert tokens == sum(len(r.logprobs) for g in groups for r in g if not r.truncated)


async def test_each_rank_masks_the_truncated_rows_of_its_shard_as_world_size_1_does(
        tmp_path: Path, tq_session: None, tiny_llama: Path) -> None:
    """Two FSDP2 ranks on the session's Ray: the flags reach each rank with its groups, and the step's normaliser
    counts only the kept rows of every rank, so the step trains world size 1's masked loss."""
    trainer = {"groups_per_step": GROUPS, "lr": 1e-3, "loss": {"mask_truncated": True}}
    one_config = tiny_config(tmp_path, "unused", trainer=trainer, model={"name": str(tiny_llama)})
    two_config = tiny_config(tmp_path, "unused", trainer={**trainer, "world_size": 2},
                             model={"name": str(tiny_llama)}, data_plane={"ray": {"num_cpus": 5}})
    one = GRPOTrainer(one_config, build_policy(one_config.model, one_config.run.seed))
    # Rows cut in both ranks' shards (each trains two whole groups of four).
    groups = truncating(batch(0), cut={0, 3, 9, 14})
    kept = sum(len(r.logprobs) for g in groups for r in g if not r.truncated)
    async with TrainerGroup.open(two_config) as two:
        a = one.step(groups, 1)
        b = await anyio.to_thread.run_sync(two.step, groups, 1)
        assert b.tokens == a.tokens == kept < sum(len(r.logprobs) for g in groups for r in g)
        assert b.loss == pytest.approx(a.loss, abs=1e-5)
        await anyio.to_thread.run_sync(assert_close, weights_of(one.model), two.live_weights())
