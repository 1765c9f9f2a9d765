"""GRPO: group-normalised advantages, PPO-clip against the generation logprobs, AdamW."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scd.config import Config
from scd.model.policy import Policy, state_copy
from scd.model.sampling import Sampling
from scd.records import Rollout
from scd.telemetry import metrics
from scd.training.base import StepResult, StepShare, TrainerStatistics


def combine(shares: Sequence[StepShare], rewards: Sequence[float]) -> StepResult:
    """The step's result from every rank's share (one share at world size 1)."""
    tokens = sum(s.tokens for s in shares)
    on_policy = sum(s.mismatch_tokens for s in shares)
    return StepResult(
        loss=sum(s.loss for s in shares), reward_mean=sum(rewards) / len(rewards),
        clip_fraction=sum(s.clipped_tokens for s in shares) / tokens,
        entropy=sum(s.entropy_sum for s in shares) / tokens, tokens=tokens,
        logprob_mismatch_mean=sum(s.mismatch_sum for s in shares) / on_policy if on_policy else None,
        logprob_mismatch_max=max(s.mismatch_max for s in shares if s.mismatch_tokens) if on_policy else None,
        logprob_mismatch_tokens=on_policy,
        slowest_rank_s=max(s.seconds for s in shares), fastest_rank_s=min(s.seconds for s in shares),
    )


@dataclass(frozen=True, slots=True)
class CopiedState:
    """Weights and optimizer state already copied to host memory."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]

    def write(self, model_path: Path, optimizer_path: Path) -> None:
        torch.save(self.model, model_path)
        torch.save(self.optimizer, optimizer_path)


def completion_tokens(groups: Sequence[Sequence[Rollout]]) -> int:
    """The tokens a step's loss is normalised over: every completion token of every row."""
    return sum(len(r.logprobs) for g in groups for r in g)


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group."""
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def completion_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under ``logp``, the sampling distribution at every position."""
    return logp[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


class GRPOTrainer:
    """The policy, its optimizer and the GRPO step: in scd's process at world size 1, and in each
    rank of a ``TrainerGroup``, sharded (``sharded``: FSDP2 over the default process group)."""

    def __init__(self, config: Config, policy: Policy, *, sharded: bool = False) -> None:
        torch.manual_seed(config.run.seed)
        self.policy = policy
        self.device = torch.device(config.trainer.device)
        self.model = policy.build_model().to(self.device)
        self.cfg = config.trainer
        self.sampling = Sampling.of(config.generation)
        self.sharded = sharded
        self.world_size = 1
        if sharded:
            from scd.training.sharding import shard_model

            self.world_size = shard_model(self.model, policy, config.trainer)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """A host-memory copy of the weights, safe to write or ship while training goes on."""
        return state_copy(self.model)

    def live_weights(self) -> dict[str, torch.Tensor]:
        """The model's own tensors, where they live (no copy): what a weight sync sends.  Valid until the
        next optimizer step; a generation backend that keeps them past the sync must copy them."""
        return self.model.state_dict()

    def state_copy(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Weights and optimizer state copied to host memory, for a checkpoint written while training goes on.

        Sharded, every rank takes part and rank 0 gets the whole (gathered) state, others empty dicts;
        the optimizer state is keyed by parameter index either way, so a bundle restores at any world size.
        """
        if self.sharded:
            from scd.training.sharding import full_state

            return full_state(self.model, self.optimizer)
        optimizer = self.optimizer.state_dict()
        return self.weights(), copy.deepcopy({
            "state": {k: {n: t.to("cpu") if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                      for k, v in optimizer["state"].items()},
            "param_groups": optimizer["param_groups"],
        })

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        """Weights and optimizer state as ``state_copy`` gave them (a restored bundle's), whole on every rank."""
        if self.sharded:
            from scd.training.sharding import load_full_state

            load_full_state(self.model, self.optimizer, model, optimizer)
            return
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)

    def capture_state(self) -> CopiedState:
        return CopiedState(*self.state_copy())

    def load_state_files(self, model_path: Path, optimizer_path: Path) -> None:
        """``load_state`` from a bundle's files; blocking."""
        self.load_state(torch.load(model_path, weights_only=True), torch.load(optimizer_path, weights_only=True))

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(world_size=1, last_export_s=0.0)

    def step(self, groups: Sequence[Sequence[Rollout]], weight_version: int) -> StepResult:
        """One optimisation step on ``groups`` with the weights of ``weight_version``; blocking (worker thread)."""
        share = self.train_share(groups, weight_version, completion_tokens(groups))
        metrics.trainer_rank_step_seconds.labels("slowest").set(share.seconds)
        metrics.trainer_rank_step_seconds.labels("fastest").set(share.seconds)
        return combine([share], [r.reward for g in groups for r in g])

    def train_share(self, groups: Sequence[Sequence[Rollout]], weight_version: int, step_tokens: int) -> StepShare:
        """This rank's part of one step: the loss over its ``groups``, normalised by ``step_tokens`` (the
        whole step's, on every rank), so that gradients summed over ranks are world size 1's gradient."""
        started = time.perf_counter()
        rows = [row for group in groups for row in group]
        advantages = torch.cat([
            group_advantages(torch.tensor([r.reward for r in g]), self.cfg.advantage_eps) for g in groups
        ])
        width = max(len(r.input_ids) for r in rows)
        tokens = torch.full((len(rows), width), self.policy.pad_id, dtype=torch.int64)
        old_logp = torch.zeros(len(rows), width - 1)
        mask = torch.zeros(len(rows), width - 1)
        for i, r in enumerate(rows):
            n = len(r.input_ids)
            tokens[i, :n] = r.input_ids
            # Position p predicts token p+1; completion tokens start at prompt_len.
            span = slice(r.prompt_len - 1, n - 1)
            old_logp[i, span] = r.logprobs
            mask[i, span] = 1.0

        tokens, old_logp, mask = tokens.to(self.device), old_logp.to(self.device), mask.to(self.device)
        advantages = advantages.to(self.device)
        self.model.train()
        # The truncated sampling distribution, as generation drew from it (scd.model.sampling): a token
        # outside the new weights' top-k / top-p set has ratio 0, which the clip keeps out of the gradient.
        logp = self.sampling.logprobs(self.policy.logits(self.model, tokens))
        # Prompt and padding positions, outside every completion, may be -inf: 0 there, as old_logp is.
        new_logp = completion_logprobs(logp, tokens).masked_fill(mask == 0, 0.0)
        ratio = torch.exp(new_logp - old_logp)
        adv = advantages.unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.cfg.clip_eps, 1 + self.cfg.clip_eps)
        surrogate = -torch.minimum(ratio * adv, clipped * adv)
        n_tokens = mask.sum()
        # FSDP averages gradients over the ranks: scaled by the world size, each rank's sum over the
        # whole step's tokens adds up to the world-size-1 loss.
        policy_loss = (surrogate * mask).sum() / step_tokens
        loss = policy_loss
        # Measured on every step (a logged 0 would read as a collapsed policy); in the graph only with a bonus.
        with torch.set_grad_enabled(bool(self.cfg.entropy_coef)):
            kept = logp[:, :-1]
            # Truncated tokens have probability 0 and add nothing (0 x -inf would be NaN).
            token_entropy = -(kept.exp() * kept.masked_fill(kept.isinf(), 0.0)).sum(-1)
            entropy_sum = (token_entropy * mask).sum()
        if self.cfg.entropy_coef:
            loss = loss - self.cfg.entropy_coef * entropy_sum / step_tokens

        self.optimizer.zero_grad(set_to_none=True)
        (loss * self.world_size).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            clipped_tokens = (((ratio - 1).abs() > self.cfg.clip_eps).float() * mask).sum()
            on_policy = torch.tensor([r.weight_version == weight_version and r.single_version for r in rows],
                                     device=self.device)
            gap = ((new_logp - old_logp).abs() * mask)[on_policy]
            on_policy_tokens = int(mask[on_policy].sum())
        return StepShare(
            loss=float(loss.detach()), tokens=int(n_tokens), clipped_tokens=float(clipped_tokens),
            entropy_sum=float(entropy_sum.detach()),
            mismatch_sum=float(gap.sum()) if on_policy_tokens else 0.0,
            mismatch_max=float(gap.max()) if on_policy_tokens else 0.0,
            mismatch_tokens=on_policy_tokens, seconds=time.perf_counter() - started,
        )
