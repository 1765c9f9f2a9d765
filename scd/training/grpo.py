"""GRPO: group-normalised advantages, PPO-clip against the generation logprobs, AdamW."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from scd.config import Config
from scd.records import Rollout
from scd.training.policy import Policy, state_copy


@dataclass(slots=True)
class StepResult:
    loss: float
    reward_mean: float
    clip_fraction: float
    entropy: float
    tokens: int
    # |trainer logprob - generation logprob| over the tokens of rows made entirely by the weights
    # being trained (other rows differ by design); None when the step had no such row.
    logprob_mismatch_mean: float | None
    logprob_mismatch_max: float | None
    logprob_mismatch_tokens: int


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group."""
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def completion_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probability of each next token, at the sampling temperature."""
    logp = F.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


class GRPOTrainer:
    def __init__(self, config: Config, policy: Policy) -> None:
        torch.manual_seed(config.run.seed)
        self.policy = policy
        self.device = torch.device(config.trainer.device)
        self.model = policy.build_model().to(self.device)
        self.cfg = config.trainer
        self.temperature = config.generation.temperature
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
        """Weights and optimizer state copied to host memory, for a checkpoint written while training goes on."""
        optimizer = self.optimizer.state_dict()
        return self.weights(), copy.deepcopy({
            "state": {k: {n: t.to("cpu") if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                      for k, v in optimizer["state"].items()},
            "param_groups": optimizer["param_groups"],
        })

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        """Weights and optimizer state as ``state_copy`` gave them (a restored bundle's)."""
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)

    def step(self, groups: Sequence[Sequence[Rollout]], weight_version: int) -> StepResult:
        """One optimisation step on ``groups`` with the weights of ``weight_version``; blocking (worker thread)."""
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
        logits = self.policy.logits(self.model, tokens)
        new_logp = completion_logprobs(logits, tokens, self.temperature)
        ratio = torch.exp(new_logp - old_logp)
        adv = advantages.unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.cfg.clip_eps, 1 + self.cfg.clip_eps)
        surrogate = -torch.minimum(ratio * adv, clipped * adv)
        n_tokens = mask.sum()
        policy_loss = (surrogate * mask).sum() / n_tokens
        loss = policy_loss
        entropy = torch.zeros(())
        if self.cfg.entropy_coef:
            probs = F.softmax(logits[:, :-1] / self.temperature, dim=-1)
            token_entropy = -(probs * F.log_softmax(logits[:, :-1] / self.temperature, dim=-1)).sum(-1)
            entropy = (token_entropy * mask).sum() / n_tokens
            loss = loss - self.cfg.entropy_coef * entropy

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            clip_fraction = (((ratio - 1).abs() > self.cfg.clip_eps).float() * mask).sum() / n_tokens
            on_policy = torch.tensor([r.weight_version == weight_version and r.single_version for r in rows],
                                     device=self.device)
            gap = ((new_logp - old_logp).abs() * mask)[on_policy]
            on_policy_tokens = int(mask[on_policy].sum())
        return StepResult(
            loss=float(loss.detach()), reward_mean=float(torch.tensor([r.reward for r in rows]).mean()),
            clip_fraction=float(clip_fraction), entropy=float(entropy.detach()), tokens=int(n_tokens),
            logprob_mismatch_mean=float(gap.sum() / on_policy_tokens) if on_policy_tokens else None,
            logprob_mismatch_max=float(gap.max()) if on_policy_tokens else None,
            logprob_mismatch_tokens=on_policy_tokens,
        )
