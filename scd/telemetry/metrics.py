"""Every Prometheus family scd exports (DESIGN §7), on the default registry.

The default registry is deliberate: vLLM registers its own families there, so
one /metrics shows both.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

generation_tokens = Counter("scd_generation_tokens", "Tokens the generation backend produced")
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
replay_groups = Gauge("scd_replay_groups", "Ready groups in the replay index")
replay_rows = Gauge("scd_replay_rows", "Rows of ready groups in TransferQueue")
ledger_prompts = Gauge("scd_ledger_prompts", "Prompts in the ledger by state", ["state"])
groups_evicted_stale = Counter("scd_groups_evicted_stale", "Groups evicted outside the staleness window")
train_reward_mean = Gauge("scd_train_reward_mean", "Mean reward of the last train step")
train_staleness = Gauge("scd_train_staleness_versions", "Max weight-version lag in the last train step")
loop_stall = Histogram(
    "scd_event_loop_stall_seconds", "How late the event loop woke a periodic probe",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
