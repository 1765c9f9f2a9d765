"""Experiment trackers (TensorBoard, W&B offline, MLflow file store) and skew telemetry, read back with each
tool's own reader, across a SIGKILL and a restore; a tracker that raises or hangs never stops training."""

from __future__ import annotations

import json
import logging
import re
import signal
import struct
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
import pytest
from prometheus_client import REGISTRY

from scd import cli, faults
from scd.checkpoint import layout
from scd.config import derive_config
from scd.daemon import Controller
from scd.schema import RunIdentity, Sidecar, TrainingInfo, decode
from scd.skew import Fate, PromptBuckets, PromptFates, bucket_prompts
from scd.telemetry import tracker_hub, trackers
from scd.telemetry.trackers import StepMark, point_of
from tests.conftest import REPO, ScdProcess, tiny_config, write_config

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ALL_TRACKERS = """trackers = ["tensorboard", "wandb", "mlflow"]
sample_every_steps = 2
sample_rows = 3
[telemetry.wandb]
mode = "offline"

[checkpointing]
enabled = true
interval_s = 3600
keep_last = 2
"""
GROUPS_PER_STEP = 8  # tests/conftest.py's TINY


# ---- reading each tracker back with its own tools ------------------------------------------------


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float, float]]:
    """(step, wall time, value) of ``tag``, every point kept, read with TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.wall_time, e.value) for e in accumulator.Scalars(tag)]


def tensorboard_texts(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    """(step, markdown) of a text summary ``tag``, as TensorBoard's text plugin reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in accumulator.Tensors(tag)]


_WANDB_BLOCK = 32 * 1024  # a W&B run file is a LevelDB-style log: 32 KiB blocks of checksummed chunks
_WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a W&B run file (``run-<id>.wandb``), decoded with W&B's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, chunks = _WANDB_HEADER, []
    while pos + 7 <= len(data):
        if _WANDB_BLOCK - pos % _WANDB_BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _WANDB_BLOCK - pos % _WANDB_BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_history(run_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    """(run id, history rows) of one offline run directory."""
    (path,) = run_dir.glob("run-*.wandb")
    run_id, rows = "", []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            # A key with "/" comes as its parts.
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


def mlflow_client(out: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A user's own reader of scd's default store: no opt-out of anything deprecated."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    return MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")


def tracker_mark(out: Path, name: str) -> int:
    """The newest step a tracker's process has marked as logged (its ``StepMark`` file), 0 before any."""
    try:
        lines = (out / "trackers" / f"{name}.jsonl").read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    return max((orjson.loads(line)["step"] for line in lines if line.endswith(b"}")), default=0)


def strictly_increasing(values: list[float]) -> bool:
    return all(a < b for a, b in pairwise(values))


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- one logical run across a SIGKILL, in every tracker -----------------------------------------------


@pytest.mark.slow
def test_every_tracker_shows_one_run_across_a_sigkill_and_restore(
    tmp_path: Path, scd_processes: list[ScdProcess], monkeypatch: pytest.MonkeyPatch, session_ray: str
) -> None:
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=ALL_TRACKERS)
    out = tmp_path / "out"
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("step 3 version")
    first.signal(signal.SIGUSR1)
    first.wait_for_line("checkpoint step_")
    (bundle,) = layout.finalized_bundles(out / "checkpoints")
    k = layout.step_of(bundle)
    assert k is not None
    # Steps past the bundle reach the trackers, then die with the process: the restore trains them again.
    first.wait_for_line(f"step {k + 5} version")
    # The trackers run at a lower priority and may lag on a loaded box: kill only once every tracker has logged
    # a step past the bundle (its mark is past k + 1: marks advance just before their step is logged) and W&B's
    # file (the last to write, through its own service) holds one.
    deadline = time.monotonic() + 120
    while not (all(tracker_mark(out, name) > k + 1 for name in ("tensorboard", "wandb", "mlflow")) and any(
            row.get("trainer/step", 0) > k for run_file in (out / "wandb").glob("offline-run-*/run-*.wandb")
            for row in wandb_history(run_file.parent)[1])):
        assert time.monotonic() < deadline, "a tracker never logged a step past the bundle"
        time.sleep(0.5)
    first.kill_group()
    run = decode(bundle / layout.TRAINING_INFO_FILE, TrainingInfo).run
    assert run is not None

    events_path = out / "events.jsonl"
    reached = max(e["step"] for e in map(orjson.loads, events_path.read_bytes().splitlines())
                  if e["event"] == "train_step")
    last = reached + 8  # past every step the trackers may hold from before the crash
    second = ScdProcess(config, "--max-steps", str(last))
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    assert "experiment tracker" not in first.output() + second.output()

    events = [orjson.loads(line) for line in events_path.read_bytes().splitlines()]
    restart = [e["time"] for e in events if e["event"] == "start"][1]
    trained = [e["step"] for e in events if e["event"] == "train_step"]
    retrained = {s for s in trained if trained.count(s) == 2}
    assert retrained == set(range(k + 1, reached + 1)), "the log holds the steps trained before the crash and again"
    final = layout.finalized_bundles(out / "checkpoints")[-1]
    # The same run, its crash restart counted (the checkpoint interval's MTBF estimate).
    final_run = decode(final / layout.TRAINING_INFO_FILE, TrainingInfo).run
    assert final_run == msgspec.structs.replace(run, crash_restores=1, run_s=final_run.run_s)
    assert final_run.run_s > run.run_s  # the run's seconds went on from the bundle's

    def check_axes(steps: list[int], run_s: list[float]) -> None:
        """Train steps 1..last, none twice; the run's clock goes on across the restart."""
        assert strictly_increasing(steps) and steps[0] == 1 and steps[-1] == last, steps
        assert set(range(1, last + 1)) - set(steps) <= retrained, "only retrained steps may be missing"
        assert strictly_increasing(run_s) and run_s[0] > 0
        assert any(r < restart - run.started_at for r in run_s) and any(r > restart - run.started_at for r in run_s)

    def check_clock(times: list[float], run_s: list[float]) -> None:
        """The tracker's own timestamps are the events' wall-clock times; ``time/run_s`` counts from the run's
        first start."""
        assert [t - run.started_at for t in times] == pytest.approx(run_s, abs=2e-3)

    # TensorBoard: one run directory, written by both processes.
    assert [p.name for p in (out / "tensorboard").iterdir()] == [run.run_id]
    run_dir = out / "tensorboard" / run.run_id
    loss = tensorboard_scalars(run_dir, "train/loss")
    check_axes([s for s, _, _ in loss], [t - run.started_at for _, t, _ in loss])
    clock = tensorboard_scalars(run_dir, "time/run_s")
    check_clock([t for _, t, _ in clock], [v for _, _, v in clock])
    assert [s for s, _, _ in tensorboard_scalars(run_dir, "restore/phases/total")] == [k]
    # What the policy wrote, every second step, each step once.
    texts = tensorboard_texts(run_dir, "completions")
    assert strictly_increasing([s for s, _ in texts]) and all(s % 2 == 0 for s, _ in texts), texts
    assert {s for s, _ in texts} >= set(range(2, last + 1, 2)) - retrained
    header, _, *table = texts[-1][1].splitlines()
    assert header == "| epoch | prompt_id | prompt | completion | answer | reward |" and len(table) == 3
    completions = [e for e in events if e["event"] == "completions"]
    last_sampled = last - last % 2  # every second step
    assert [e["step"] for e in completions][-1] == last_sampled and all(len(e["rows"]) == 3 for e in completions)
    assert set(completions[-1]["rows"][0]) == {"epoch", "prompt_id", "prompt", "completion", "answer", "reward"}

    # W&B: one run id, an offline directory per process, the trainer step as the axis.
    histories = [wandb_history(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
    assert len(histories) == 2 and {run_id for run_id, _ in histories} == {run.run_id}
    rows = [row for _, history in histories for row in history if "train/loss" in row]
    check_axes([r["trainer/step"] for r in rows], [r["time/run_s"] for r in rows])
    # A table's history entry comes as its parts (completions/_type, completions/path, ...).
    tables = [row for _, history in histories for row in history if "completions/_type" in row]
    assert tables and all(t["completions/_type"] == "table-file" and t["completions/nrows"] == 3
                          and t["trainer/step"] % 2 == 0 for t in tables)

    # MLflow: one run, tagged with the run id.
    client = mlflow_client(out, monkeypatch)
    (experiment,) = [e for e in client.search_experiments() if e.name == "scd"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.data.tags["scd.run_id"] == run.run_id and mlflow_run.info.status == "FINISHED"
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    check_axes([m.step for m in history], [m.timestamp / 1000 - run.started_at for m in history])
    clock = client.get_metric_history(mlflow_run.info.run_id, "time/run_s")
    check_clock([m.timestamp / 1000 for m in clock], [m.value for m in clock])
    artifacts = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "completions")]
    assert f"completions/step_{last_sampled:08d}.json" in artifacts
    assert all(re.fullmatch(r"completions/step_\d{8}\.json", a) for a in artifacts)

    # Skew counts are part of the cut: every train step of the surviving history is counted, once.
    fates = decode(final / layout.SIDECAR_FILE, Sidecar).prompt_fates
    assert sum(f[Fate.TRAINED] for f in fates.values()) == last * GROUPS_PER_STEP
    # Lost to the crash: exactly the cut's in-flight prompts generation ran again (one whose every sibling the
    # cut kept was not lost; on a loaded box that can be all of them).
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert sum(f[Fate.LOST_TO_CRASH] for f in fates.values()) == restore["prompts_redispatched"]
    assert all(f[Fate.ADMITTED] >= f[Fate.TRAINED] for f in fates.values())


# ---- trackers that fail -------------------------------------------------------------------------------


async def test_a_tracker_that_raises_is_disabled_once_and_training_goes_on(
        tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # MLflow's deprecated file store, chosen explicitly, still works: scd opts its tracker's process in.
    file_store = (tmp_path / "mlruns").resolve().as_uri()
    config = tiny_config(tmp_path, partition, telemetry={"trackers": ["tensorboard", "mlflow"],
                                                         "mlflow": {"tracking_uri": file_store}})
    errors = counter("scd_tracker_errors_total", tracker="tensorboard")
    # The tracker's process is given the armed spec: TensorBoard's third log call raises there.
    with caplog.at_level(logging.WARNING, logger="scd.telemetry.tracker_hub"), faults.armed("tensorboard_log:3=fail"):
        async with Controller.open(config) as controller:
            await controller.run(max_steps=6)
    assert controller.state.trainer_step == 6
    assert counter("scd_tracker_errors_total", tracker="tensorboard") == errors + 1
    warnings = [r for r in caplog.records if r.name == "scd.telemetry.tracker_hub"]
    assert len(warnings) == 1 and "SCD_FAULT at tensorboard_log" in warnings[0].getMessage()
    assert "tensorboard" in warnings[0].getMessage()
    # The other tracker went on.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=file_store)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("scd").experiment_id])
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]


async def test_a_hung_tracker_never_delays_a_pump(tmp_path: Path, partition: str, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # What a hung tracker may hold before lines are dropped: 2 KiB queued, a page of pipe, and what its process
    # reads ahead (a few lines): about 10 train steps' lines.
    monkeypatch.setattr(tracker_hub, "QUEUE_BYTES", 2048)
    monkeypatch.setattr(tracker_hub, "PIPE_BYTES", 4096)
    monkeypatch.setattr(tracker_hub, "CLOSE_TIMEOUT_S", 1.0)
    config = tiny_config(tmp_path, partition, telemetry={"trackers": ["tensorboard"]})
    dropped = counter("scd_tracker_dropped_records_total", tracker="tensorboard")
    errors = counter("scd_tracker_errors_total", tracker="tensorboard")
    stalls: list[float] = []

    async def probe() -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            stalls.append(time.monotonic() - before - 0.01)

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="scd.telemetry.tracker_hub"), faults.armed("tensorboard_log=block"):
        async with Controller.open(config) as controller, anyio.create_task_group() as tg:
            tg.start_soon(probe)
            await controller.run(max_steps=30)
            tg.cancel_scope.cancel()
    assert time.monotonic() - started < 60
    assert controller.state.trainer_step == 30
    assert counter("scd_tracker_dropped_records_total", tracker="tensorboard") >= dropped + 5
    # The tracker hangs for the whole run; the loop never waits on it (the bound leaves room for a
    # loaded 2-core box).
    assert max(stalls) < 2.0, max(stalls)
    # Closing could not hand it the end, waited its bound, then killed the hung process; no error counted.
    behind, killed = [r.getMessage() for r in caplog.records if r.name == "scd.telemetry.tracker_hub"]
    assert re.search(r"tensorboard was \d+ bytes behind at exit", behind), behind
    assert "tensorboard did not finish within 1s: killed" in killed
    assert counter("scd_tracker_errors_total", tracker="tensorboard") == errors


def test_a_listed_tracker_without_its_package_exits_2_before_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real_find_spec = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("the daemon started")

    monkeypatch.setattr(cli.anyio, "run", no_ray)
    config = write_config(tmp_path, extra='trackers = ["tensorboard", "wandb"]\n')
    assert cli.main(["run", str(config)]) == 2
    error = capsys.readouterr().err
    assert "telemetry.trackers" in error and "wandb" in error and "scd[trackers]" in error


def test_tracker_settings_are_checked_naming_the_key(tmp_path: Path) -> None:
    from scd.errors import ConfigError

    base = REPO / "configs" / "tiny.toml"
    for telemetry, key in (({"trackers": ["comet"]}, "telemetry.trackers"),
                           ({"trackers": ["wandb", "wandb"]}, "telemetry.trackers"),
                           ({"wandb": {"mode": "sometimes"}}, "telemetry.wandb.mode"),
                           ({"wandb": {"project": ""}}, "telemetry.wandb.project")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            derive_config(base, {"telemetry": telemetry})
    with pytest.raises(ConfigError, match=r"task\.bucket_field"):
        derive_config(base, {"task": {"bucket_field": "difficulty"}})
    config = derive_config(base, {"run": {"output_dir": str(tmp_path)}})
    assert config.telemetry.mlflow.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert config.telemetry.mlflow.artifact_location == tmp_path.resolve().joinpath("mlartifacts").as_uri()
    assert config.telemetry.tensorboard.dir == str(tmp_path / "tensorboard")


# ---- what a tracker is given ---------------------------------------------------------------------------

RUN = RunIdentity(run_id="r1", started_at=1000.0)


def test_a_step_mark_is_appended_per_step_and_survives_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "trackers" / "wandb.jsonl"
    mark = StepMark(path, "r1")
    assert mark.step == 0
    for step in (1, 2, 3):
        mark.advance(step)
    assert len(path.read_bytes().splitlines()) == 4  # the start's line, then one per step
    with path.open("ab") as f:
        f.write(b'{"run_id": "r1", "st')  # a crash in the middle of a line: its step was not logged yet
    again = StepMark(path, "r1")
    assert again.step == 3 and path.read_bytes().splitlines() == [b'{"run_id":"r1","step":3}']
    assert StepMark(path, "another run").step == 0


def test_points_carry_the_event_numbers_on_both_axes() -> None:
    step = point_of({"event": "train_step", "time": 1010.5, "step": 7, "loss": 0.25, "trained_tokens": 512,
                     "prompt_ids": [[0, 1]], "logprob_mismatch_mean": None, "shadow": True,
                     "trained_per_admitted": {"hard": 0.5}}, RUN)
    assert step is not None and step.train and (step.step, step.time) == (7, 1010.5)
    assert step.scalars == {"time/run_s": 10.5, "train/loss": 0.25, "train/trained_tokens": 512.0,
                            "train/trained_per_admitted/hard": 0.5}
    completed = point_of({"event": "checkpoint", "time": 1020.0, "step": 9, "outcome": "completed",
                          "reason": "interval", "phases": {"total": 1.5, "tq_save": 0.5}, "groups": 3}, RUN)
    assert completed is not None and not completed.train
    assert completed.scalars == {"time/run_s": 20.0, "checkpoint/completed": 1.0, "checkpoint/phases/total": 1.5,
                                 "checkpoint/phases/tq_save": 0.5, "checkpoint/groups": 3.0}
    assert point_of({"event": "checkpoint", "time": 1.0, "step": 9, "outcome": "scheduled"}, RUN) is None
    assert point_of({"event": "sample", "time": 1.0, "step": 9, "replay_groups": 4}, RUN) is None


# ---- skew --------------------------------------------------------------------------------------------


def test_buckets_by_field_then_prompt_length_then_completion_length() -> None:
    by_field = bucket_prompts("difficulty", ["hard", "easy", "3", "10", "easy"], [1] * 5, [1] * 5)
    assert by_field.labels == ("3", "10", "easy", "hard") and by_field.of_prompt == (3, 2, 0, 1, 2)
    by_prompt = bucket_prompts("", [""] * 8, [1, 1, 2, 2, 3, 3, 4, 4], [5] * 8)
    assert by_prompt.basis == "prompt_tokens" and by_prompt.labels == tuple(f"prompt_tokens:{n}" for n in (1, 2, 3, 4))
    tied = bucket_prompts("", [""] * 8, [5, 5, 5, 5, 5, 5, 9, 9], [5] * 8)
    assert tied.labels == ("prompt_tokens:5", "prompt_tokens:9") and tied.of_prompt == (0,) * 6 + (1,) * 2
    by_completion = bucket_prompts("", [""] * 4, [6] * 4, [2, 30, 2, 30])
    assert by_completion.labels == ("completion_tokens:2", "completion_tokens:30")
    assert bucket_prompts("", [""] * 3, [6] * 3, [4] * 3) == PromptBuckets.single(3)


def test_a_jsonl_bucket_field_is_read_per_prompt_and_checked(tmp_path: Path) -> None:
    from scd.config import TaskConfig
    from scd.errors import ConfigError
    from scd.tasks import build_task

    task = skew_task(tmp_path / "task.jsonl", prompts=4)
    config = TaskConfig(name="jsonl", path=str(task), bucket_field="difficulty")
    assert [p.bucket for p in build_task(config)] == ["short", "long", "short", "long"]
    with task.open("a") as f:
        f.write('{"prompt": "9=", "answer": "9"}\n')
    with pytest.raises(ConfigError, match=r"task\.bucket_field.*:5: needs a string or number field 'difficulty'"):
        build_task(config)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(f'{{"prompt": "1=", "answer": "1", "id": {i}}}\n' for i in range(65)))
    with pytest.raises(ConfigError, match="65 distinct values"):
        build_task(TaskConfig(name="jsonl", path=str(many), bucket_field="id"))


def test_tvd_between_admitted_and_trained() -> None:
    fates = PromptFates(bucket_prompts("d", ["short", "long"], [1, 1], [1, 1]))
    assert fates.tvd() == 0.0
    for _ in range(10):
        fates.count(0, Fate.ADMITTED)
        fates.count(1, Fate.ADMITTED)
        fates.count(0, Fate.TRAINED)
    assert fates.tvd() == pytest.approx(0.5)
    assert fates.trained_per_admitted() == {"long": 0.0, "short": 1.0}
    for _ in range(10):
        fates.count(1, Fate.TRAINED)
    assert fates.tvd() == pytest.approx(0.0)
    restored = PromptFates(fates.buckets)
    restored.load({**fates.counts(), "gone": {"admitted": 3}})
    assert restored.counts() == fates.counts()


def test_bundles_without_run_identity_or_fates_still_read(tmp_path: Path) -> None:
    info = {"schema_version": 4, "step": 3, "weight_version": 3, "epoch": 0, "group_size": 8, "sampler": "windowed",
            "supports_replay_checkpoint": True, "partition": "p", "replay_digest": "d", "groups": 0, "samples": 0,
            "capacity": 32, "time": 1.0, "config_fingerprint": "f", "config_fingerprint_fields": {}, "files": {},
            "sidecar_bytes": 0, "data_plane_bytes": 0}
    (tmp_path / "training_info.json").write_bytes(orjson.dumps(info))
    assert decode(tmp_path / "training_info.json", TrainingInfo).run is None
    sidecar = {"schema_version": 4, "partition": "p", "replay_digest": "d", "groups": [],
               "ledger": {"entries": [], "pruned": {}}, "sampler": {"name": "windowed", "state": {},
                                                                    "supports_replay_checkpoint": True}}
    (tmp_path / "sidecar.json").write_bytes(msgspec.json.encode(sidecar))
    assert decode(tmp_path / "sidecar.json", Sidecar).prompt_fates == {}


def skew_task(path: Path, prompts: int = 64) -> Path:
    """Half the prompts short (a 2-character answer), half long (24): their bucket is the difficulty column."""
    with path.open("w") as f:
        for i in range(prompts):
            long = i % 2 == 1
            f.write(orjson.dumps({"prompt": f"{i:04d}=", "answer": "7" * (24 if long else 2),
                                  "difficulty": "long" if long else "short"}).decode() + "\n")
    return path


async def skew_after(tmp_path: Path, partition: str, length_from: str,
                     steps: int = 30) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """The last train_step event and the prompts' fates after ``steps`` steps."""
    config = tiny_config(
        tmp_path / length_from, partition, task={"name": "jsonl", "path": str(skew_task(tmp_path / "task.jsonl")),
                                                 "bucket_field": "difficulty"},
        # A continuous-batching engine: a short group started beside a long one finishes first.
        generation={"backend": "synthetic", "group_size": 4, "max_new_tokens": 24, "max_inflight_prompts": 32,
                    "synthetic": {"length_from": length_from, "min_completion_tokens": 2, "max_completion_tokens": 24,
                                  "tokens_per_s": 5_000.0, "scheduling": "slots", "batch_groups": 1,
                                  "max_concurrent_batches": 16}},
        trainer={"groups_per_step": 4},
        # A tight window, and more admitted than it can train: what generates slowly goes stale.
        async_rl={"buffer_capacity_groups": 48, "pace_admission": False,
                  "sampler": {"name": "windowed", "max_staleness_versions": 0}})
    async with Controller.open(config) as controller:
        await controller.run(max_steps=steps)
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
    return [e for e in events if e["event"] == "train_step"][-1], controller.state.fates.counts()


async def test_a_tight_window_starves_the_long_bucket_and_the_tvd_shows_it(tmp_path: Path, partition: str) -> None:
    tied, tied_fates = await skew_after(tmp_path, partition, "answer")
    uniform, uniform_fates = await skew_after(tmp_path, partition, "range")
    assert tied["trained_per_admitted"]["long"] < tied["trained_per_admitted"]["short"]
    assert tied_fates["long"]["dropped_stale"] > tied_fates["short"]["dropped_stale"]
    assert tied["training_skew_tvd"] > 0.2 > uniform["training_skew_tvd"], (tied_fates, uniform_fates)
    # /metrics shows the same counts (the last controller's).
    assert counter("scd_prompts_total", bucket="long", fate="trained") == uniform_fates["long"]["trained"]


def test_report_draws_trained_per_admitted_per_bucket(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from scd.report import write_report

    events = [{"event": "start", "time": 1000.0, "step": 0}]
    for step in range(1, 41):
        long = max(0.0, 0.9 - 0.02 * step)
        events.append({"event": "train_step", "time": 1000.0 + step, "step": step, "reward_mean": 0.1,
                       "training_skew_tvd": (0.9 - long) / 2, "trained_per_admitted": {"short": 0.9, "long": long}})
    events.append({"event": "train_step", "time": 1100.0, "step": 41, "reward_mean": 0.1})  # an older scd's
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    summary = write_report(log, tmp_path / "report")
    assert (tmp_path / "report" / "skew.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "training skew TVD (last step)" in summary and "0.4000" in summary
