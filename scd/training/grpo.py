"""GRPO: group-normalised advantages, the configured PPO-clip loss (``[trainer.loss]``, scd.training.loss), AdamW.

At every world size the optimizer updates fp32 master weights and keeps fp32 state while the model computes
in ``model.dtype`` (autocast in scd's own process, FSDP2's ``MixedPrecisionPolicy`` on ranks), unless
``trainer.master_dtype = "model"``; generation and exports get the weights in ``model.dtype``.  Logprobs
come from the final hidden states a chunk of completion tokens at a time (``scd.training.logprobs``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scd.config import Config
from scd.errors import EXIT_OTHER, ScdError
from scd.model.policy import Policy, state_copy
from scd.model.sampling import Sampling
from scd.model.weights import StorageKey, save_digested, storage_key
from scd.records import Rollout
from scd.telemetry import metrics
from scd.training.base import StepResult, StepShare, TrainerStatistics
from scd.training.logprobs import chunk_tokens_for, token_logprobs
from scd.training.loss import LossSettings, RatioSums, StepSize, policy_loss, step_advantages
from scd.training.schedule import lr_factor

log = logging.getLogger(__name__)


def ratios_by_staleness(shares: Sequence[StepShare]) -> dict[int, RatioSums]:
    """The shares' token statistics added up by staleness."""
    by_staleness: dict[int, RatioSums] = {}
    for share in shares:
        for lag, sums in share.ratios.items():
            by_staleness[lag] = by_staleness[lag] + sums if lag in by_staleness else sums
    return dict(sorted(by_staleness.items()))


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
        is_ratio=ratios_by_staleness(shares),
        skipped=next((s.skipped for s in shares if s.skipped), None), lr=shares[0].lr,
    )


class NonFiniteSteps(ScdError):
    """``trainer.max_skipped_steps`` train steps in a row had a loss or gradient norm that is not finite."""

    exit_code = EXIT_OTHER


class SkippedSteps:
    """Counts the train steps that took no optimizer step, and those in a row: ``trainer.max_skipped_steps`` of
    them in a row stop the run (the weights stayed those of the last good step, and so does every bundle)."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def after(self, result: StepResult, groups: Sequence[Sequence[Rollout]], weight_version: int) -> None:
        if result.skipped is None:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        metrics.train_steps_skipped.labels(result.skipped).inc()
        rewards = [r.reward for g in groups for r in g]
        log.warning("train step on weight version %d skipped its optimizer step: its %s is not finite (loss %s); "
                    "its %d groups, %d rows, %d tokens, rewards %.4g..%.4g; %d in a row of trainer.max_skipped_steps "
                    "= %d", weight_version, result.skipped, result.loss, len(groups), len(rewards), result.tokens,
                    min(rewards), max(rewards), self.in_a_row, self.max_in_a_row)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(
                f"{self.in_a_row} train steps in a row had a {result.skipped} that is not finite "
                f"(trainer.max_skipped_steps = {self.max_in_a_row}); none was applied: the weights and the last "
                "bundle are those of the last good step")


def publish(result: StepResult) -> None:
    """The step's gauges that the trainer measures: its ranks' seconds and its importance ratios by staleness
    (a lag the step had no rows of is dropped, not left at an older step's value)."""
    metrics.trainer_rank_step_seconds.labels("slowest").set(result.slowest_rank_s)
    metrics.trainer_rank_step_seconds.labels("fastest").set(result.fastest_rank_s)
    metrics.train_is_ratio.clear()
    for lag, stats in result.is_ratio_stats().items():
        for stat, value in stats.items():
            metrics.train_is_ratio.labels(lag, stat).set(value)
    metrics.train_behaviour_kl.clear()
    for lag, value in result.behaviour_kl().items():
        metrics.train_behaviour_kl.labels(lag).set(value)
    metrics.train_lr.set(result.lr)


def _nothing() -> None:
    return None


@dataclass(slots=True)
class CopiedState:
    """Weights and optimizer state already copied to host memory; ``written`` runs once they are written or
    the write failed, or the capture is discarded unwritten (host buffers lent to the capture go back then)."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    written: Callable[[], None] = _nothing

    def write(self, model_path: Path, optimizer_path: Path) -> tuple[str, str]:
        try:
            return save_digested(self.model, model_path), save_digested(self.optimizer, optimizer_path)
        finally:
            # A failed write (a full disk) gives the buffers back too: each later capture would pin a new
            # set the size of model and optimizer otherwise.
            self.release()

    def release(self) -> None:
        """Once, however often it is called: a second give-back would lend the same buffers to two captures."""
        written, self.written = self.written, _nothing
        written()


Buffers = dict[str, torch.Tensor]


def pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


class HostBuffers:
    """Host memory that a capture of device tensors copies into, kept for the next capture: allocating (and,
    on CUDA, pinning) gigabytes of host memory at every checkpoint would cost more than the copy.  A set of
    buffers is lent to one capture until its files are written; a capture while another's write is still
    going gets a set of its own, so a capture never overwrites one being written."""

    def __init__(self, allocate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``allocate``: an empty host tensor of the shape and dtype of the one given."""
        self._allocate = allocate
        self._free: list[Buffers] = []
        self._lock = threading.Lock()

    def lend(self) -> Buffers:
        with self._lock:
            return self._free.pop() if self._free else {}

    def give_back(self, buffers: Buffers) -> None:
        with self._lock:
            self._free.append(buffers)

    def copy(self, buffers: Buffers, prefix: str, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` with each tensor copied into its buffer in ``buffers`` (``non_blocking``: on CUDA the
        caller synchronizes), other values as they are; a tensor aliasing an earlier one (a tied embedding)
        is copied once and stays one under both names."""
        out: dict[str, Any] = {}
        copies: dict[StorageKey, torch.Tensor] = {}
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                out[name] = value
                continue
            key = storage_key(value)
            if key not in copies:
                slot = f"{prefix}.{name}"
                buffer = buffers.get(slot)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = buffers[slot] = self._allocate(value)
                copies[key] = buffer.copy_(value.detach(), non_blocking=True)
            out[name] = copies[key]
        return out


def _param_groups(optimizer_state: dict[str, Any]) -> list[dict[str, Any]]:
    """An optimizer state dict's groups, each with a list of parameters of its own."""
    return [{**group, "params": list(group["params"])} for group in optimizer_state["param_groups"]]


def step_size(config: Config, groups: Sequence[Sequence[Rollout]]) -> StepSize:
    """What the whole step's loss is divided by, counted over all its groups before any rank trains: each rank
    divides its own sum by it, so a sharded step trains world size 1's loss."""
    rows = [r for g in groups for r in g]
    return StepSize.of([len(r.logprobs) for r in rows], [r.truncated for r in rows],
                       LossSettings.of(config.trainer.loss),
                       config.generation.max_new_tokens)


def split_mini_batches(groups: Sequence[Sequence[Rollout]], count: int) -> list[list[Sequence[Rollout]]]:
    """The step's groups as ``count`` disjoint slices of consecutive whole groups, one per optimizer step
    (the config checks that ``count`` divides them)."""
    size = len(groups) // count
    return [list(groups[i * size:(i + 1) * size]) for i in range(count)]


def merged(shares: Sequence[StepShare]) -> StepShare:
    """One train step's share from those of its mini-batches: sums added, its loss their mean (each mini-batch
    normalised as a step of its own), skipped if any of its optimizer steps was."""
    return StepShare(
        loss=sum(s.loss for s in shares) / len(shares), tokens=sum(s.tokens for s in shares),
        clipped_tokens=sum(s.clipped_tokens for s in shares), entropy_sum=sum(s.entropy_sum for s in shares),
        mismatch_sum=sum(s.mismatch_sum for s in shares), mismatch_max=max(s.mismatch_max for s in shares),
        mismatch_tokens=sum(s.mismatch_tokens for s in shares), seconds=sum(s.seconds for s in shares),
        ratios=ratios_by_staleness(shares), skipped=next((s.skipped for s in shares if s.skipped), None),
        lr=shares[0].lr,
    )


def padded_rows(rows: Sequence[Rollout], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows as a batch: tokens ``[rows, width]``, their behaviour (engine) logprobs and a mask that is 1.0
    on completion tokens, ``[rows, width - 1]`` (position p predicts token p + 1)."""
    width = max(len(r.input_ids) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    behaviour = torch.zeros(len(rows), width - 1)
    mask = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        tokens[i, :n] = r.input_ids
        # Completion tokens start at prompt_len.
        span = slice(r.prompt_len - 1, n - 1)
        behaviour[i, span] = r.logprobs
        mask[i, span] = 1.0
    return tokens, behaviour, mask


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
        # A rank of a sharded trainer builds the model empty and allocates only its own shards, once sharded.
        self.model = policy.build_empty_model() if sharded else policy.build_model().to(self.device)
        self.config = config
        self.cfg = config.trainer
        self.loss = LossSettings.of(config.trainer.loss)
        self.skipped_steps = SkippedSteps(config.trainer.max_skipped_steps)
        self.sampling = Sampling.of(config.generation)
        self.sharded = sharded
        self.world_size = 1
        # What generation and exports get, and what the model computes in.
        self.model_dtype = getattr(torch, config.model.dtype)
        self.compute_dtype = getattr(torch, self.cfg.param_dtype) if self.cfg.param_dtype else self.model_dtype
        master = torch.float32 if self.cfg.master_dtype == "float32" else self.model_dtype
        if master != torch.float32:
            log.warning("trainer.master_dtype = \"model\": the optimizer updates %s weights; updates below "
                        "their resolution are lost", config.model.dtype)
        self.model.to(master)
        if self.cfg.activation_checkpointing:
            from torch.distributed._composable import checkpoint

            for layer in policy.decoder_layers(self.model):
                checkpoint(layer)
        # FSDP casts the parameters to the compute dtype; in this process autocast does.
        self._autocast = not sharded and self.compute_dtype != master
        if sharded:
            from torch.distributed.fsdp import register_fsdp_forward_method

            from scd.training.sharding import fill_shards, shard_model

            self.world_size = shard_model(self.model, policy, config.trainer, self.compute_dtype, master)
            fill_shards(self.model, policy, self.device, self.model_dtype)
            # The logprobs are computed through the model, as its forward is: FSDP gathers the root's
            # parameters (embedding, final norm, output head) around it and reduces their gradients after.
            # Only sharded: the model holding a method of its trainer keeps both alive in a reference cycle
            # until a garbage collection, and a rank's trainer lives as long as its process anyway.
            self.model.scd_completion_logprobs = self._completion_logprobs
            register_fsdp_forward_method(self.model, "scd_completion_logprobs")
        # A sharded model's head is checked with its weights in (``output_head`` computes through the model); the
        # check's forward leaves the root's parameters gathered, as FSDP keeps them for a backward.
        self.head = policy.output_head(self.model)
        if sharded:
            self.model.reshard()
        self.chunk_tokens = chunk_tokens_for(self.head.weight.shape[0], self.cfg.logprob_chunk_tokens)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        for group in self.optimizer.param_groups:
            # The rate the schedule scales (torch's LRScheduler's name for it); "lr" is the scheduled one of the
            # last step.  Both go into a bundle with the optimizer state.
            group["initial_lr"] = self.cfg.lr
        if self.device.type == "cuda" and not sharded:  # what ``capture_state`` copies into
            self._host_buffers = HostBuffers(pinned_like)
            self._copy_stream = torch.cuda.Stream(self.device)

    def weights(self) -> dict[str, torch.Tensor]:
        """A host-memory copy of the weights, safe to write or ship while training goes on."""
        return state_copy(self.model)

    def live_weights(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: the model's own tensors where they live (no copy), or in ``model.dtype``
        when the masters are kept in another.  Valid until the next optimizer step; a generation backend that
        keeps them past the sync must copy them.  A tied tensor (an embedding that is also the output head)
        is cast once and stays one tensor under both names, so a sync sends it once (``unaliased``)."""
        cast: dict[StorageKey, torch.Tensor] = {}
        out = {}
        for name, tensor in self.model.state_dict().items():
            key = storage_key(tensor)
            if key not in cast:
                cast[key] = tensor.to(self.model_dtype) if tensor.is_floating_point() else tensor
            out[name] = cast[key]
        return out

    def state_copy(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Weights and optimizer state copied to host memory, for a checkpoint written while training goes on.

        Sharded, every rank takes part and rank 0 gets the whole (gathered) state, others empty dicts;
        the optimizer state is keyed by parameter index either way, so a bundle restores at any world size.
        """
        if self.sharded:
            from scd.training.sharding import full_state

            return full_state(self.model, self.optimizer)
        optimizer = self.optimizer.state_dict()
        # Copied once, to host memory: the next step updates the live state in place.
        return self.weights(), {
            "state": {k: {n: t.to("cpu", copy=True) if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                      for k, v in optimizer["state"].items()},
            "param_groups": _param_groups(optimizer),
        }

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> dict[str, list[float]]:
        """Weights and optimizer state as ``state_copy`` gave them (a restored bundle's), whole on every rank.

        The configured optimizer settings apply, not the bundle's (``optimizer.load_state_dict`` would bring
        back its ``param_groups``): returns each that changed, ``[old, new]``."""
        if self.sharded:
            from scd.training.sharding import load_full_state

            load_full_state(self.model, self.optimizer, model, optimizer)
        else:
            self.model.load_state_dict(model)
            self.optimizer.load_state_dict(optimizer)
        configured = {"initial_lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay}
        changes: dict[str, list[float]] = {}
        for group in self.optimizer.param_groups:
            # A bundle's "lr" is its last step's scheduled rate; the configured one compares with its base, which
            # a bundle from before schedules lacks: its rate was constant, its "lr" the base.
            group.setdefault("initial_lr", group["lr"])
            for key, value in configured.items():
                if group[key] != value:
                    changes["trainer.lr" if key == "initial_lr" else f"trainer.{key}"] = [group[key], value]
                    if key == "initial_lr":  # the bundle's scheduled factor, of the new base until the next step
                        group["lr"] = value * (group["lr"] / group[key])
                    group[key] = value
        return changes

    def lr_at(self, steps_taken: int) -> float:
        """The learning rate of the optimizer step that follows ``steps_taken`` steps: ``trainer.lr`` times
        ``trainer.lr_schedule``'s factor, the schedule planned over ``run.max_steps``."""
        cfg = self.cfg
        return cfg.lr * lr_factor(steps_taken, total_steps=self.config.run.max_steps, schedule=cfg.lr_schedule,
                                  warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)

    def capture_state(self) -> CopiedState:
        if self.sharded or self.device.type != "cuda":
            return CopiedState(*self.state_copy())
        return self._pinned_capture()

    def _pinned_capture(self) -> CopiedState:
        """On CUDA: into pinned host buffers kept across captures, on a stream of its own (a pageable copy is
        synchronous and runs at a fraction of the bus's speed), waiting for the step's work before it starts
        and done before the next step can change a tensor."""
        buffers = self._host_buffers.lend()
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            model = self._host_buffers.copy(buffers, "model", self.model.state_dict())
            optimizer = self.optimizer.state_dict()
            state = {index: self._host_buffers.copy(buffers, f"optimizer.{index}", values)
                     for index, values in optimizer["state"].items()}
        self._copy_stream.synchronize()
        return CopiedState(model, {"state": state, "param_groups": _param_groups(optimizer)},
                           functools.partial(self._host_buffers.give_back, buffers))

    def load_state_files(self, model_path: Path, optimizer_path: Path) -> dict[str, list[float]]:
        """``load_state`` from a bundle's files; blocking."""
        return self.load_state(torch.load(model_path, weights_only=True),
                               torch.load(optimizer_path, weights_only=True))

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(world_size=1, last_export_s=0.0)

    def step(self, groups: Sequence[Sequence[Rollout]], weight_version: int) -> StepResult:
        """One optimisation step on ``groups`` with the weights of ``weight_version``; blocking (worker thread)."""
        slices = split_mini_batches(groups, self.cfg.mini_batches)
        share = self.train_mini_batches(slices, weight_version, [step_size(self.config, s) for s in slices])
        result = combine([share], [r.reward for g in groups for r in g])
        publish(result)
        self.skipped_steps.after(result, groups, weight_version)
        return result

    def computing(self) -> torch.autocast:
        """The context the model computes in: autocast to the compute dtype over fp32 masters."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self._autocast)

    def completion_token_logprobs(self, tokens: torch.Tensor,
                                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each next token's logprob under the truncated sampling distribution, as generation drew from it
        (scd.model.sampling), and the entropy there, ``[rows, length - 1]``; 0 outside the completions (``mask``).
        A token outside the new weights' top-k / top-p set has logprob -inf: ratio 0, kept out of the gradient
        by the clip."""
        return (self.model.scd_completion_logprobs if self.sharded else self._completion_logprobs)(tokens, mask)

    def _completion_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = mask.bool()
        hidden = self.policy.hidden(self.model, tokens)[:, :-1][at]
        chosen, entropy = token_logprobs(hidden, tokens[:, 1:][at], self.head, self.sampling, self.chunk_tokens,
                                         entropy_in_loss=bool(self.cfg.entropy_coef))
        zeros = torch.zeros(mask.shape, dtype=chosen.dtype, device=mask.device)
        return zeros.masked_scatter(at, chosen), zeros.masked_scatter(at, entropy)

    def train_mini_batches(self, slices: Sequence[Sequence[Sequence[Rollout]]], weight_version: int,
                           sizes: Sequence[StepSize]) -> StepShare:
        """This rank's part of one train step of ``trainer.mini_batches`` optimizer steps: ``slices[m]`` its
        groups of mini-batch m, ``sizes[m]`` that whole mini-batch's size over every rank.

        Each mini-batch is normalised as a step of its own (verl's ppo_mini_batch: its loss is its own token
        mean, or its own aggregation's), and clipped against the proximal logprobs: the weights the train step
        started from, computed for every row without gradients before the first update, so a later
        mini-batch's trust region is the pre-step policy's, not the one the earlier mini-batches moved to (the
        first mini-batch's are its own forward, detached, as at one mini-batch: the extra forward covers the
        later ones' rows only).
        Every optimizer step has the train step's learning rate (the schedule counts train steps) and is
        skipped on its own when its loss or gradient norm is not finite, the others applying; the train step
        reports a skip if any was.  One mini-batch is ``train_share`` as it always was: no extra forward."""
        if len(slices) == 1:
            return self.train_share(slices[0], weight_version, sizes[0])
        later = [self.proximal_logprobs(groups) for groups in slices[1:]]
        return merged([self.train_share(slices[0], weight_version, sizes[0], clip_to_proximal=True),
                       *(self.train_share(groups, weight_version, size, proximal=before)
                         for groups, size, before in zip(slices[1:], sizes[1:], later, strict=True))])

    def proximal_logprobs(self, groups: Sequence[Sequence[Rollout]]) -> torch.Tensor:
        """The logprobs of the rows of ``groups`` under the current weights, without gradients, laid out as
        ``train_share`` lays out those rows."""
        tokens, _, mask = (t.to(self.device) for t in padded_rows([r for g in groups for r in g],
                                                                   self.policy.pad_id))
        self.model.train()
        with torch.no_grad(), self.computing():
            return self.completion_token_logprobs(tokens, mask)[0]

    def train_share(self, groups: Sequence[Sequence[Rollout]], weight_version: int, size: StepSize, *,
                    proximal: torch.Tensor | None = None, clip_to_proximal: bool = False) -> StepShare:
        """This rank's part of one optimizer step: the loss over its ``groups`` divided by the whole step's
        ``size`` (on every rank), so that gradients summed over ranks are world size 1's gradient.

        Of scd.training.loss's three logprobs, the behaviour ones are the rollouts' (the engine's) and the
        current ones this forward's.  The proximal ones, the weights' the train step starts from, are
        ``proximal`` when given (a later mini-batch's, ``train_mini_batches``), otherwise the current ones
        detached: before the train step's first optimizer step the pre-update policy is the policy of this very
        forward, and no extra forward is needed.  Without an off-policy correction, a given ``proximal`` or
        ``clip_to_proximal`` the clip anchors to the behaviour logprobs, the loss scd always trained."""
        started = time.perf_counter()
        rows = [row for group in groups for row in group]
        settings = self.loss
        advantages = step_advantages([[r.reward for r in g] for g in groups], self.cfg.advantage_eps,
                                     normalize_std=settings.normalize_advantage_std).to(self.device)
        tokens, behaviour, mask = (t.to(self.device) for t in padded_rows(rows, self.policy.pad_id))
        self.model.train()
        with self.computing():
            current, token_entropy = self.completion_token_logprobs(tokens, mask)
        if proximal is None and (clip_to_proximal or settings.off_policy_correction != "none"):
            proximal = current.detach()
        # Measured on every step (a logged 0 would read as a collapsed policy); in the loss only with a bonus.
        out = policy_loss(current, behaviour, advantages, mask, size, settings, proximal=proximal,
                          truncated=torch.tensor([r.truncated for r in rows], device=self.device),
                          entropy=token_entropy, entropy_coef=self.cfg.entropy_coef)
        # FSDP averages gradients over the ranks: scaled by the world size, each rank's share of the whole
        # step's loss adds up to the world-size-1 loss.
        (out.loss * self.world_size).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        # Sharded, the norm is over every rank's gradients (a rank's non-finite loss makes them all non-finite),
        # so every rank decides alike.
        grad_norm = grad_norm.full_tensor() if self.sharded else grad_norm
        skipped = "loss" if not torch.isfinite(out.loss.detach()) else \
            "grad_norm" if not torch.isfinite(grad_norm) else None
        # The weights of version v have taken v optimizer steps (the trainer step and the weight version move
        # together): the schedule's whole state is in every bundle, and a restored run goes on with it.
        lr = self.lr_at(weight_version)
        if skipped is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        # Freed now, not at the next step: a weight sync's model-dtype copy and a capture come in between.
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            on_policy = torch.tensor([r.weight_version == weight_version and r.single_version for r in rows],
                                     device=self.device)
            # Against the weights the train step started from: a later mini-batch's current ones have moved.
            gap = (((current if proximal is None else proximal) - behaviour).abs() * mask)[on_policy]
            on_policy_tokens = int(mask[on_policy].sum())
        # Staleness: how many versions the weights that drew a row are behind the ones trained.
        lags = [weight_version - r.weight_version for r in rows]
        whole = out.statistics.sums()
        return StepShare(
            loss=float(out.loss.detach()), tokens=int(whole.tokens), clipped_tokens=whole.clipped,
            entropy_sum=whole.entropy_sum,
            mismatch_sum=float(gap.sum()) if on_policy_tokens else 0.0,
            mismatch_max=float(gap.max()) if on_policy_tokens else 0.0,
            mismatch_tokens=on_policy_tokens, seconds=time.perf_counter() - started,
            ratios={lag: out.statistics.sums(torch.tensor([x == lag for x in lags], device=self.device))
                    for lag in sorted(set(lags))},
            skipped=skipped, lr=lr,
        )
