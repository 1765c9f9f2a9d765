"""The offline event-log report (plots and summary) and the shipped Grafana dashboard."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest

from scd.errors import ScdError
from scd.report import write_report
from tests.conftest import ScdProcess, free_port, write_config
from tests.support.prometheus import Prometheus

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("reward.png", "learning.png", "eval.png", "throughput.png", "checkpoint_phases.png", "restore_times.png")
T0 = 1_700_000_000.0


def _event(event: str, time: float, step: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": T0 + time, "step": step, **fields}


def _train_step(time: float, step: int, *, rates: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "epoch": step // 20, "weight_version": step, "reward_mean": min(1.0, 0.1 + 0.02 * step),
        "loss": 1.0 / step, "entropy": 2.0 - 0.01 * step, "completion_tokens_mean": 8.0 - step / 10,
        "truncation_rate": max(0.0, 0.9 - step / 40), "staleness": step % 3,
        "prompt_ids": [[step // 20, 4 * step + k] for k in range(4)],
    }
    if rates:
        fields |= {"committed_groups_per_s": 2.5, "generated_tokens_per_s": 5200.0 + step,
                   "committed_tokens_per_s": 4100.0 + step}
    return _event("train_step", time, step, **fields)


def _checkpoint(time: float, step: int, outcome: str, reason: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"outcome": outcome, "reason": reason}
    if outcome == "completed":
        fields["phases"] = {"total": 1.9 + 0.01 * step, "tq_save": 1.1, "barrier_wait": 0.2, "exclusive_hold": 0.4,
                            "sidecar_write": 0.15, "commit": 0.05}
    return _event("checkpoint", time, step, **fields)


def _realistic_log() -> list[dict[str, Any]]:
    """Process 1 trains steps 1-30 and checkpoints; it dies; process 2 restores step 25 and trains to 40."""
    events = [_event("start", 0.0, 0, pid=1001)]
    for step in range(1, 31):
        events.append(_train_step(10.0 * step, step, rates=step > 5))  # the early steps predate the rate fields
        events.append(_event("sample", 10.0 * step + 5, step, replay_groups=8, inflight_prompts=32))
        if step % 5 == 0:
            events.append(_checkpoint(10.0 * step + 1, step, "completed", "interval"))
    events += [
        _checkpoint(305.0, 30, "skipped", "no_progress"),
        _checkpoint(306.0, 30, "failed", "tq_timeout"),
        _event("shutdown_requested", 307.0, 30),  # an event kind this report does not know
        _event("start", 400.0, 25, pid=2002),
        _event("restore", 412.0, 25, bundle="/ckpt/step-000025", groups_restored=7, groups_evicted_stale=2,
               prompts_redispatched=5, phases={"resolve": 0.3, "dataloader": 0.1, "tq": 8.4, "replay_metadata": 0.6,
                                               "ledger": 0.4, "total": 9.8}),
    ]
    for step in range(26, 41):
        events.append(_train_step(412.0 + 9.0 * (step - 25), step, rates=True))
    for step, reward in ((0, 0.1), (20, 0.3), (40, 0.7)):
        events.append(_event("eval", 412.0 + 9.0 * 15 + 0.5 if step == 40 else 10.0 * step + 2, step,
                              weight_version=step, prompts=8, samples_per_prompt=4, reward_mean=reward,
                              pass_at_k={"1": reward / 2, "2": reward, "4": min(1.0, 2 * reward)},
                              reward_components={"digits": reward}, seconds=0.5, tokens=256,
                              rows=[{"epoch": 0, "prompt_id": 0, "prompt": [{"role": "user", "content": "reverse 12"}],
                                     "completion": "21" if step else "x", "answer": "21", "reward": reward}]))
    events.append(_event("completions", 412.0 + 9.0 * 15, 40, rows=[
        {"epoch": 1, "prompt_id": 3, "prompt": "reverse 34", "completion": "43", "answer": "43", "reward": 1.0}]))
    events.append(_checkpoint(412.0 + 9.0 * 15 + 1, 40, "completed", "shutdown"))
    return events


def _write_log(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events) + b"\n")  # a trailing blank line
    return path


def _summary_rows(summary: str) -> dict[str, str]:
    """The table's rows: up to the blank line before the sample completions."""
    rows = {}
    for line in summary.splitlines()[3:]:
        if not line:
            break
        label, value = re.split(r"\s{2,}", line.strip())
        rows[label] = value
    return rows


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 10_000, path


def test_report_writes_plots_and_summary(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "events.jsonl", _realistic_log())
    out = tmp_path / "report" / "nested"

    summary = write_report(log, out)

    for name in PLOTS:
        _assert_png(out / name)
    rows = _summary_rows(summary)
    assert rows["run span (s)"] == f"{412.0 + 9.0 * 15 + 1:.1f}"
    assert rows["processes"] == "2"
    assert rows["restores"] == "1"
    assert rows["train steps (max step)"] == "40"
    assert rows["final reward (mean of last 10)"] == "0.8100"  # steps 31-40
    assert rows["checkpoints"] == "9"
    assert rows["checkpoints completed"] == "7"
    assert rows["completed, reason interval"] == "6"
    assert rows["completed, reason shutdown"] == "1"
    assert rows["checkpoints skipped"] == "1"
    assert rows["skipped, reason no_progress"] == "1"
    assert rows["checkpoints failed"] == "1"
    assert rows["failed, reason tq_timeout"] == "1"
    assert rows["checkpoint total max (s)"] == "2.300"
    assert rows["restore total mean (s)"] == "9.800"
    assert rows["eval steps"] == "3"
    assert rows["eval reward (step 0 -> 40)"] == "0.1000 -> 0.7000"
    assert rows["eval pass@4 (step 40)"] == "1.0000"
    assert rows["figures not written (no data)"] == "goodput.png, skew.png"
    table = summary.split("\n\n")[0]
    widths = {len(line) for line in table.splitlines()[1:]}
    assert len(widths) == 1, "the table is fixed-width"
    # What the policy wrote, as a person reads it: the last completions event's rows and the last eval's.
    assert "sample completions (step 40):\n  'reverse 34' -> '43'  (answer '43', reward 1.000)" in summary
    assert "held-out eval samples (step 40):\n  'reverse 12' -> '21'  (answer '21', reward 0.700)" in summary
    assert sorted(p.name for p in out.iterdir()) == sorted(PLOTS)


def test_a_figure_without_data_is_not_written_and_the_summary_names_it(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "events.jsonl", [_event("start", 0.0, 0, pid=7), _train_step(5.0, 1, rates=False)])

    summary = write_report(log, tmp_path / "out")

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["learning.png", "reward.png"]
    for name in ("learning.png", "reward.png"):
        _assert_png(tmp_path / "out" / name)
    rows = _summary_rows(summary)
    assert rows["figures not written (no data)"] == ("eval.png, throughput.png, goodput.png, checkpoint_phases.png, "
                                                     "restore_times.png, skew.png")
    assert rows["restores"] == "0"
    assert rows["checkpoints completed"] == "0"
    assert rows["checkpoint total mean (s)"] == "n/a"
    assert rows["restore total mean (s)"] == "n/a"
    assert rows["eval steps"] == "0"


def test_a_line_a_crash_tore_is_skipped_with_a_warning_naming_it(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    events = _realistic_log()
    log = _write_log(tmp_path / "events.jsonl", events[:3])
    whole = _write_log(tmp_path / "whole.jsonl", events)
    with log.open("ab") as f:
        f.write(b'{"event": "train_step", "time": 1700000040.0, "st\n')  # a torn write: line 5, after a blank
        f.write(whole.read_bytes().split(b"\n", 3)[3])  # the next process's lines after it
    with caplog.at_level(logging.WARNING, logger="scd.report"):
        summary = write_report(log, tmp_path / "out")
    assert [r.getMessage().split(": not valid JSON")[0] for r in caplog.records] == [f"{log}:5"]
    # Every other line counted, as in the same log untorn.
    assert summary.replace(str(log), "LOG") == write_report(whole, tmp_path / "whole-out").replace(str(whole), "LOG")


def test_malformed_known_event_raises_naming_the_line(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "events.jsonl", [_event("start", 0.0, 0, pid=1), _event("train_step", 1.0, 1)])
    with pytest.raises(ScdError, match=r":2: .*reward_mean"):
        write_report(log, tmp_path / "out")


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ScdError, match="not found"):
        write_report(tmp_path / "absent.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_file_raises(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"\n\n")
    with pytest.raises(ScdError, match="no scd events"):
        write_report(log, tmp_path / "out")


# ---- the Grafana dashboard ------------------------------------------------------------------------

DASHBOARD = REPO / "configs" / "grafana" / "scd-dashboard.json"
ROWS = ("Generation", "Goodput", "Usable output", "Checkpoint latency", "Backpressure", "Reliability", "Restore",
        "Recovery efficiency", "Snapshot size", "Loss window and trainer ranks")
REQUIRED_METRICS = {
    "scd_generation_tokens_total", "scd_committed_tokens_total", "scd_committed_groups_total",
    "scd_checkpoint_phase_seconds_bucket", "scd_checkpoint_blocked_mutations_total", "scd_checkpoint_attempts_total",
    "scd_restore_phase_seconds_bucket", "scd_recovery_groups_restored", "scd_checkpoint_sidecar_bytes",
    "scd_engine_busy_ratio", "scd_engine_busy_bound", "scd_generation_waste_ratio", "scd_goodput_ratio",
    "scd_work_at_risk_tokens", "scd_work_at_risk_seconds", "scd_checkpoint_interval_seconds",
    "scd_trainer_rank_step_seconds", "scd_trainer_world_size",
}
PROMQL_WORDS = {"rate", "increase", "sum", "by", "le", "histogram_quantile", "time"}


def test_grafana_dashboard_rows_and_metric_names() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert (dashboard["schemaVersion"], dashboard["uid"], dashboard["title"]) == (39, "scd-main", "scd")
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    panels = dashboard["panels"]
    assert tuple(p["title"] for p in panels if p["type"] == "row") == ROWS
    assert panels[0]["type"] == "row" and panels[-1]["type"] != "row"
    assert all(b["type"] != "row" for a, b in pairwise(panels) if a["type"] == "row"), \
        "every row is followed by its panels"

    exprs = [t["expr"] for p in panels if p["type"] != "row" for t in p["targets"]]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels if p["type"] != "row")
    used = set()
    for expr in exprs:
        names = set(re.findall(r"scd_[a-z_]+", expr))
        assert names, expr
        # Apart from PromQL keywords and label names, every identifier is an scd_ metric.
        others = set(re.findall(r"\b[a-z_]+\b", re.sub(r"\{[^}]*\}|\([a-z_, ]+\)\s*\(", "(", expr))) - names
        assert others <= PROMQL_WORDS, (expr, others)
        used |= names
    assert used >= REQUIRED_METRICS, REQUIRED_METRICS - used



def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the shipped dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def test_a_real_prometheus_has_data_for_every_dashboard_query_on_a_healthy_run(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    """A healthy run (no waste, no restore, a checkpoint every 2 s) scraped by a real Prometheus: every query
    of the dashboard returns a series, so no panel reads "no data".  A quantile of a histogram that has had no
    observation (no restore yet, no mutation blocked) is a series whose value is NaN: Grafana draws it as a
    gap, not "no data"."""
    port = free_port()
    config = write_config(tmp_path, max_steps=100_000, port=port, ray_address=session_ray)
    scd = ScdProcess(config, "--set", "checkpointing.enabled=true", "--set", "checkpointing.interval_s=2.0")
    scd_processes.append(scd)
    prometheus = Prometheus(tmp_path / "prometheus", free_port(), port)
    try:
        scd.wait_for_line("checkpoint step_")
        prometheus.wait_for_scrapes(5)
        # Until the first train step some panels have nothing to show yet (a loaded box's first step
        # can come after the first bundle): wait for the condition itself.
        deadline = time.monotonic() + 90
        while ((empty := [(title, expr) for title, expr in dashboard_queries() if not prometheus.query(expr)])
               and time.monotonic() < deadline):
            time.sleep(1)
        nan = [expr for _, expr in dashboard_queries()
               if any(math.isnan(float(s["value"][1])) for s in prometheus.query(expr))]
        # A NaN only where the quantile's histogram had no observation within its range.
        observed = {expr: [float(s["value"][1]) for s in prometheus.query(observations_of(expr))] for expr in nan}
    finally:
        prometheus.close()
    scd.signal(signal.SIGTERM)
    assert scd.wait(timeout=120) == 0, scd.output()[-3000:]
    assert empty == [], empty
    assert all(counts == [0.0] for counts in observed.values()), observed
    assert any("restore" in expr for expr in nan), nan  # this run restored nothing: its quantiles are NaN


def observations_of(quantile: str) -> str:
    """The PromQL counting the observations a ``histogram_quantile`` query reads, over its range."""
    [(name, window)] = set(re.findall(r"(scd_[a-z_]+)_bucket\[(\w+)\]", quantile))
    return f"sum(increase({name}_count[{window}]))"
