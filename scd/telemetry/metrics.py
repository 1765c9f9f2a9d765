"""Every Prometheus family scd exports, on the default registry.

The default registry is deliberate: vLLM registers its own families there, so
one /metrics shows both.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scd.ledger import PromptState
from scd.records import WasteReason
from scd.skew import PromptFates

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

generation_tokens = Counter("scd_generation_tokens", "Tokens the generation backend produced")
completions = Counter("scd_completions", "Completions generated, by why they ended (eos, stop, length, abort)",
                      ["finish_reason"])
completion_tokens = Histogram(
    "scd_completion_tokens", "Tokens of each complete completion generated (a resumed one's prefix included)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
committed_tokens = Counter("scd_committed_tokens", "Tokens of groups committed to the replay buffer")
committed_groups = Counter("scd_committed_groups", "Groups committed to the replay buffer")
group_completion_latency = Histogram(
    "scd_group_completion_latency_seconds", "Admission to commit of a group", buckets=_LATENCY_BUCKETS
)
group_admission_latency = Histogram(
    "scd_group_admission_latency_seconds", "Admission to the start of generation of a group",
    buckets=_LATENCY_BUCKETS,
)
trainer_step = Gauge("scd_trainer_step", "Trainer steps completed")
weight_version = Gauge("scd_weight_version", "Weight version of the policy")
trainer_world_size = Gauge("scd_trainer_world_size", "Trainer ranks (1: the trainer runs in scd's process)")
trainer_rank_step_seconds = Gauge("scd_trainer_rank_step_seconds",
                                  "Seconds the last step took on its slowest and its fastest rank", ["stat"])
trainer_weight_export_seconds = Gauge(
    "scd_trainer_weight_export_seconds",
    "Seconds the last weight sync spent gathering whole tensors out of the trainer's shards")
replay_groups = Gauge("scd_replay_groups", "Ready groups in the replay index")
replay_rows = Gauge("scd_replay_rows", "Rows of ready groups in TransferQueue")
ledger_prompts = Gauge("scd_ledger_prompts", "Prompts in the ledger by state", ["state"])
# Every known label value has a sample from the first scrape: a healthy run's panels show 0, not "no data".
for _state in PromptState:
    ledger_prompts.labels(_state.value)
groups_evicted_stale = Counter("scd_groups_evicted_stale", "Groups evicted outside the staleness window")
groups_filtered = Counter(
    "scd_groups_filtered", "Complete groups whose rewards were all equal, never trained "
    "(async_rl.drop_zero_variance_groups)")
filtered_tokens = Counter("scd_generation_filtered_tokens",
                          "Completion tokens of the groups filtered for zero reward variance: not trained, not waste")
train_reward_mean = Gauge("scd_train_reward_mean", "Mean reward of the last train step")
train_staleness = Gauge("scd_train_staleness_versions", "Max weight-version lag in the last train step")
train_logprob_mismatch = Gauge(
    "scd_train_logprob_mismatch",
    "Mean and max |trainer logprob - generation logprob| of the last step's on-policy tokens", ["stat"],
)
train_steps_skipped = Counter(
    "scd_train_steps_skipped",
    "Train steps that took no optimizer step (weights unchanged), by what was not finite: loss or grad_norm",
    ["reason"],
)
train_behaviour_kl = Gauge(
    "scd_train_behaviour_kl",
    "Mean per-token k3 estimate of KL(behaviour || proximal) of the last step's tokens by staleness: how far the "
    "engine that drew them was from the weights the step starts from",
    ["staleness"],
)
train_lr = Gauge("scd_train_lr", "Learning rate of the last train step's optimizer step (trainer.lr_schedule)")
train_is_ratio = Gauge(
    "scd_train_is_ratio",
    "Proximal / behaviour logprob ratio of the last step's tokens by staleness (versions the weights that drew "
    "them lag the trained ones): mean, max, and clipped_share, the share the off-policy correction capped or masked",
    ["staleness", "stat"],
)
weight_sync = Histogram(
    "scd_weight_sync_seconds",
    "Trainer weights to live in the generation backend, per sync, by the path that delivered them "
    "(transfer, reload, in_process, none)", ["path"], buckets=_LATENCY_BUCKETS,
)
weight_sync_failures = Counter(
    "scd_weight_sync_failures", "Weight-sync attempts that failed (then retried, or reloaded), by path", ["path"]
)
# ---- vLLM engines (scd.generation.vllm_backend) --------------------------------------------------
engine_inflight_requests = Gauge("scd_engine_inflight_requests", "Requests each vLLM engine is generating now",
                                 ["engine"])
engine_generated_tokens = Counter("scd_engine_generated_tokens", "Tokens each vLLM engine generated", ["engine"])
engine_requests = Counter("scd_engine_requests", "Requests (a group, or its missing siblings) sent to each vLLM engine",
                          ["engine"])
groups_redispatched = Counter(
    "scd_generation_groups_redispatched", "Groups generation gave back incomplete (aborted) and dispatched again"
)
loop_stall = Histogram(
    "scd_event_loop_stall_seconds", "How late the event loop woke a periodic probe",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)

# ---- goodput: how busy generation is, its bound, what it throws away (scd.goodput) ---------------
engine_busy_ratio = Gauge(
    "scd_engine_busy_ratio",
    "Share of wall time with at least one request in flight, per engine, over telemetry.goodput_window_s",
    ["engine"],
)
engine_busy_bound = Gauge(
    "scd_engine_busy_bound", "min(1, R_t / R_g): the most an engine can be busy without generating waste"
)
trainer_groups_per_second = Gauge(
    "scd_trainer_groups_per_second", "R_t: groups the trainer takes per second of its own work (read, step, sync)"
)
trainer_starved_ratio = Gauge(
    "scd_trainer_starved_ratio",
    "Share of wall time the trainer waited for a batch, over telemetry.goodput_window_s (engines fall short of "
    "their bound by it)",
)
generation_groups_per_second = Gauge(
    "scd_generation_groups_per_second", "R_g: groups generation makes per busy second, summed over engines"
)
generation_waste_ratio = Gauge(
    "scd_generation_waste_ratio",
    "Tokens of groups dropped stale plus aborted partial tokens not reused, over tokens generated, in this run",
)
goodput_ratio = Gauge("scd_goodput_ratio", "Tokens trained over tokens generated, in this run")
wasted_tokens = Counter(
    "scd_generation_wasted_tokens", "Generated tokens thrown away, by why (stale_group, stale_sibling, aborted)",
    ["reason"],
)
for _reason in WasteReason:
    wasted_tokens.labels(_reason.value)
trained_tokens = Counter("scd_trained_tokens", "Completion tokens of the groups trained")
eval_reward_mean = Gauge("scd_eval_reward_mean", "Mean reward of the last held-out evaluation's samples")
eval_pass_at_k = Gauge("scd_eval_pass_at_k", "Unbiased pass@k of the last held-out evaluation", ["k"])
eval_step = Gauge("scd_eval_step", "Trainer step of the last held-out evaluation (-1: none yet)")
eval_seconds = Counter("scd_eval_seconds", "Seconds spent evaluating: goodput's eval row, apart from training")
eval_tokens = Counter("scd_eval_tokens", "Tokens generated for held-out evaluation: never trained, never waste")
eval_step.set(-1)
buffer_capacity_groups = Gauge(
    "scd_buffer_capacity_groups",
    "Ready plus in-flight groups: the configured limit, what the staleness window can use, what admission allows",
    ["limit"],
)

# ---- prompts (scd.model.prompts) ---------------------------------------------------------------
prompts_dropped = Counter(
    "scd_prompts_dropped", "Prompts left out of the task at load, by reason (overlong: longer than "
    "task.max_prompt_tokens, with task.overlong_prompts = \"drop\")", ["reason"],
)
prompts_dropped.labels("overlong")

# ---- rewards (scd.rewards) ---------------------------------------------------------------------
reward = Histogram(
    "scd_reward", "Each reward function's unweighted value per completion (a dict-returning one's parts as name/part)",
    ["name"], buckets=(-1.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 5.0),
)
siblings_scored = Counter("scd_siblings_scored", "Finished siblings scored by the configured rewards (once each)")
reward_unavailable = Gauge(
    "scd_reward_unavailable", "1 while a reward's service does not answer (scoring waits; nothing is regenerated)"
)
reward_errors = Counter(
    "scd_reward_errors",
    "Reward calls that failed, by reward and cause (exception, not_finite, not_a_number, timeout, crashed, http, "
    "malformed)", ["name", "cause"],
)

# ---- checkpointing ----------------------------------------------------------------------------
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
checkpoint_phase = Histogram(
    "scd_checkpoint_phase_seconds", "Time of each checkpoint phase", ["phase"], buckets=_PHASE_BUCKETS
)
checkpoint_attempts = Counter(
    "scd_checkpoint_attempts", "Checkpoint attempts by outcome and reason", ["outcome", "reason"]
)
checkpoint_blocked_mutations = Counter(
    "scd_checkpoint_blocked_mutations", "Mutations that waited for a checkpoint's exclusive hold", ["kind"]
)
checkpoint_mutation_wait = Histogram(
    "scd_checkpoint_mutation_wait_seconds", "How long a blocked mutation waited", buckets=_PHASE_BUCKETS
)
last_checkpoint_timestamp = Gauge(
    "scd_last_checkpoint_timestamp_seconds", "Wall-clock time of the last completed checkpoint"
)
checkpoint_seconds_since_success = Gauge(
    "scd_checkpoint_seconds_since_last_success", "At the last checkpoint attempt: seconds since the last completed one"
)
checkpoint_sidecar_bytes = Gauge("scd_checkpoint_sidecar_bytes", "Bytes of the last replay metadata sidecar")
checkpoint_data_plane_bytes = Gauge("scd_checkpoint_data_plane_bytes", "Bytes of the last TQ native snapshot")
work_at_risk_tokens = Gauge("scd_work_at_risk_tokens",
                            "Generated tokens the newest finalized bundle would not give back")
work_at_risk_seconds = Gauge("scd_work_at_risk_seconds", "Age of the newest finalized bundle's cut")
checkpoint_interval = Gauge("scd_checkpoint_interval_seconds",
                            "The checkpoint interval in force (interval_s = auto: the Young/Daly optimum)")
checkpoint_interval_fallbacks = Counter(
    "scd_checkpoint_interval_fallbacks",
    "Young/Daly estimates that were not positive (no cost or no run time yet): the interval fell to its clamps",
)
checkpoint_effective_cadence = Gauge(
    "scd_checkpoint_effective_cadence_seconds", "Time between the last two completed checkpoints"
)

# ---- restore -----------------------------------------------------------------------------------
restore_phase = Histogram(
    "scd_restore_phase_seconds", "Time of each restore phase", ["phase"], buckets=_PHASE_BUCKETS
)
recovery_groups_restored = Gauge("scd_recovery_groups_restored", "Ready groups restored at the last start")
recovery_groups_evicted_stale = Gauge(
    "scd_recovery_groups_evicted_stale", "Restored groups evicted as stale at the last start"
)
recovery_prompts_redispatched = Gauge(
    "scd_recovery_prompts_redispatched", "In-flight prompts dispatched again at the last start"
)
recovery_stale_tokens = Gauge(
    "scd_recovery_stale_tokens", "Tokens of restored groups and staged siblings already stale at the last start"
)
recovery_prefix_tokens_reused = Counter(
    "scd_recovery_prefix_tokens_reused",
    "Tokens of part-way or unstaged finished siblings a restore took from the bundle's prefixes")
recovery_prefix_tokens_dropped = Counter(
    "scd_recovery_prefix_tokens_dropped",
    "Tokens of the bundle's prefixes a restore threw away (out of the staleness window, or a backend that "
    "cannot resume)")
recovery_siblings_reused = Counter(
    "scd_recovery_siblings_reused", "Finished siblings of unfinished groups reused after a restart"
)
recovery_siblings_rerun = Counter(
    "scd_recovery_siblings_rerun",
    "Staged siblings a restart could not reuse (outside the staleness window, or a shadow restore): generated again",
)
siblings_staged = Counter(
    "scd_siblings_staged", "Finished siblings staged in TQ while others of their group still ran"
)
staged_siblings = Gauge("scd_staged_siblings", "Finished siblings of in-flight groups staged in TQ now")

# ---- data plane --------------------------------------------------------------------------------
owed_clears = Gauge(
    "scd_owed_clears",
    "TQ keys whose clear is owed (deferred by a save window, or left by a clear that failed): the next clear "
    "carries them",
)
owed_clear_failures = Counter(
    "scd_owed_clear_failures",
    "Owed TQ clears that failed when a save window closed; the keys stay owed and the next clear retries them",
)

# ---- experiment trackers (scd.telemetry.trackers) ----------------------------------------------
tracker_errors = Counter(
    "scd_tracker_errors", "Experiment trackers that raised and were disabled for the rest of the process", ["tracker"]
)
tracker_dropped = Counter(
    "scd_tracker_dropped_records", "Event records a tracker's full queue dropped (the tracker fell behind)",
    ["tracker"],
)


# ---- skew: prompts per bucket and fate (scd.skew) ----------------------------------------------
class _PromptFatesCollector(Collector):
    """``scd_prompts_total{bucket, fate}`` and ``scd_training_skew_tvd``, read from the run's counts at each
    scrape: a restore continues the counts (they are part of the cut), which a counter of this process
    alone could not show."""

    def __init__(self) -> None:
        self._fates: PromptFates | None = None

    def follow(self, fates: PromptFates) -> None:
        self._fates = fates

    def collect(self) -> Iterator[Metric]:
        prompts = CounterMetricFamily(
            "scd_prompts", "Prompts per bucket by fate (admitted, trained, dropped_stale, evicted, redispatched, "
            "lost_to_crash, filtered), across restarts", labels=["bucket", "fate"])
        tvd = GaugeMetricFamily("scd_training_skew_tvd",
                                "Total variation distance between admitted and trained prompts over buckets")
        fates = self._fates
        if fates is not None:
            for bucket, by_fate in fates.counts().items():
                for fate, n in by_fate.items():
                    prompts.add_metric([bucket, fate], n)
            tvd.add_metric([], fates.tvd())
        yield prompts
        yield tvd


prompt_fates = _PromptFatesCollector()
REGISTRY.register(prompt_fates)
