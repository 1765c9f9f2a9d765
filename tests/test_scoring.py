"""The scoring stage through the real controller and a real `scd run`: the rewards a user configures score
every sibling once, a bad reward stops the run with nothing lost, and a reward service's outage loses and
regenerates nothing, across a SIGKILL too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from scd.checkpoint import layout
from scd.config import derive_config, parse_config
from scd.daemon import Controller
from scd.model.init_tiny import write_tokenizer
from scd.model.policy import HFPolicy, build_policy
from scd.model.prompts import render_task
from scd.rewards import RewardInput, load_rewards
from scd.schema import Sidecar, decode
from tests.conftest import REPO, ScdProcess, free_port, tiny_config, write_config
from tests.support.reward_server import RewardService
from tests.support.waiting import wait_until

# More prompts than the runs here admit: a row is one prompt of epoch 0, its group id e0-p<id>.
ROWS = 256


def reversal_rows() -> list[dict[str, Any]]:
    """Prompts of four digits to reverse, each with an id and a level the rewards get as the row's columns."""
    rows = []
    for k in range(ROWS):
        digits = f"{(k * 7919) % 10_000:04d}"
        rows.append({"prompt": digits, "answer": digits[::-1], "id": k, "level": k % 3})
    return rows


def write_dataset(directory: Path) -> Path:
    path = directory / "train.jsonl"
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in reversal_rows()))
    return path


RECORDING = """
import json
import os
from pathlib import Path

def reward(prompt, completion, answer, row):
    with (Path(__file__).parent / "seen.jsonl").open("a") as out:
        out.write(json.dumps({"prompt": prompt, "answer": answer, "row": row, "pid": os.getpid()}) + "\\n")
    right = sum(a == b for a, b in zip(completion, answer))
    return {"score": right / len(answer), "length": float(len(completion))}
"""


async def test_a_custom_reward_gets_each_rows_columns_and_its_parts_reach_the_step_event(
        tmp_path: Path, partition: str) -> None:
    (tmp_path / "recording_reward.py").write_text(RECORDING)
    config = tiny_config(tmp_path, partition, task={
        "name": "jsonl", "path": str(write_dataset(tmp_path)),
        "rewards": [{"function": "recording_reward:reward", "name": "digits"}, {"function": "exact", "weight": 0.5}]},
        telemetry={"sample_every_steps": 1, "sample_rows": 2})
    async with Controller.open(config, config_dir=tmp_path) as controller:
        await controller.run(max_steps=2)
        scored = controller.rollouts.scoring.statistics().scored
    by_prompt = {row["prompt"]: row for row in reversal_rows()}
    seen = [orjson.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    # A call under way when the run stopped has written its line and is not counted as scored.
    assert scored >= 2 * config.trainer.groups_per_step * config.generation.group_size
    assert scored <= len(seen) <= scored + config.generation.max_inflight_prompts * config.generation.group_size
    for call in seen:
        row = by_prompt[call["prompt"]]
        assert call["answer"] == row["answer"] and call["row"] == {"id": row["id"], "level": row["level"]}
    assert os.getpid() not in {call["pid"] for call in seen}  # a sync reward runs in a worker process
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
    steps = [e for e in events if e["event"] == "train_step"]
    assert len(steps) == 2
    # What the policy wrote, every step here: the prompt as the dataset gives it, the text, the answer, the reward.
    sampled = [e for e in events if e["event"] == "completions"]
    assert [e["step"] for e in sampled] == [1, 2] and all(len(e["rows"]) == 2 for e in sampled)
    for row in (row for e in sampled for row in e["rows"]):
        assert by_prompt[row["prompt"]]["answer"] == row["answer"] and row["epoch"] == 0
        assert isinstance(row["completion"], str) and 0 <= row["reward"] <= 1.5
    for step in steps:
        assert set(step["reward_components"]) == {"digits", "digits/length", "exact"}
        assert 0 < step["reward_components"]["digits/length"] <= config.generation.max_new_tokens
        parts = step["reward_components"]
        assert step["reward_mean"] == pytest.approx(parts["digits"] + 0.5 * parts["exact"], abs=1e-6)


async def test_the_chat_example_renders_its_template_and_pays_for_the_answer_and_for_stopping(tmp_path: Path) -> None:
    """configs/chat-task.toml without its engine: the dataset its script makes, the prompts as the tokenizer's
    chat template renders them, and its two rewards."""
    made = tmp_path / "made"
    made.mkdir()
    script = REPO / "examples" / "chat_reversal" / "make_data.py"
    (made / "make_data.py").write_bytes(script.read_bytes())
    subprocess.run([sys.executable, str(made / "make_data.py")], check=True, timeout=60)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (made / name).read_bytes() == (script.parent / name).read_bytes(), f"{name} is not what the script makes"
    train = [orjson.loads(line) for line in (script.parent / "train.jsonl").read_bytes().splitlines()]
    evaluation = [orjson.loads(line) for line in (script.parent / "eval.jsonl").read_bytes().splitlines()]
    assert not {r["answer"] for r in train} & {r["answer"] for r in evaluation}

    write_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 128}')
    config = derive_config(REPO / "configs" / "chat-task.toml", {"model": {"name": str(tmp_path / "model")}})
    tokenizer = HFPolicy(config.model).tokenizer
    rendered = render_task(config, build_policy(config.model, 0)).prompts
    assert [p.token_ids for p in rendered] == [
        tuple(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for row in train]
    assert len(rendered[0].token_ids) + config.generation.max_new_tokens <= config.generation.vllm.max_model_len

    row = train[0]
    # The answer then EOS; the answer running on past it; no digit at all.
    completions = [row["answer"], row["answer"] + "00", "abcd"]
    async with contextlib.aclosing(load_rewards(config.task, REPO / "configs")) as scorer:
        scored = await scorer.score([RewardInput(0, row["prompt"], completion, row["answer"], {}, "train.jsonl:1")
                                     for completion in completions])
    assert [s.total for s in scored] == pytest.approx([1.0, 0.5, 0.0])
    assert set(scored[0].components) == {"digits", "digits/exact", "format"}


FLAGGED = """
from pathlib import Path

def reward(prompt, completion, answer, row):
    if (Path(__file__).parent / "fail-now").exists():
        raise ValueError("no verdict for " + prompt)
    return float(completion == answer)
"""


def test_a_failing_reward_stops_the_run_with_exit_1_naming_it_and_the_last_bundle_restores(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    (tmp_path / "flagged_reward.py").write_text(FLAGGED)
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=(
        '\n[[task.rewards]]\nfunction = "flagged_reward:reward"\nname = "flagged"\n'
        "\n[checkpointing]\nenabled = true\ninterval_s = 1\nkeep_last = 3\n"))
    root = tmp_path / "out" / "checkpoints"
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("checkpoint step_")
    first.wait_for_line("step 3 ")
    (tmp_path / "fail-now").touch()
    assert first.wait(timeout=120) == 1
    said = first.output()
    # The prompt as a load error would name it: a built-in's name and index (a dataset's file:line).
    assert "scd: error: reward 'flagged' (function 'flagged_reward:reward') failed on task reverse prompt " in said, \
        said[-3000:]
    assert "raised ValueError: no verdict for " in said
    bundles = layout.finalized_bundles(root)
    assert bundles and not layout.leftover_tmp_dirs(root)
    newest = layout.step_of(bundles[-1])
    verified = subprocess.run([sys.executable, "-m", "scd.cli", "checkpoint", "verify", str(bundles[-1])], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    (tmp_path / "fail-now").unlink()
    second = ScdProcess(config, "--max-steps", str(newest + 2))
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    assert f"restored {bundles[-1]}: step {newest}," in second.output()
    assert f"step {newest + 2} version {newest + 2} " in second.output()


def test_an_http_reward_whose_url_never_answers_stops_the_run_with_exit_2_naming_the_url(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    """task.reward_start_timeout_s: a wrong URL (nobody listens there) does not wait for ever."""
    url = f"http://127.0.0.1:{free_port()}/score"
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=(
        f'\n[[task.rewards]]\nfunction = "http"\nname = "remote"\nargs = {{ url = "{url}", retries = 0 }}\n'))
    config.write_text(config.read_text().replace('[task]\n', '[task]\nreward_start_timeout_s = 5\n'))
    run = ScdProcess(config)
    scd_processes.append(run)
    assert run.wait(timeout=300) == 2, run.output()[-3000:]
    said = run.output()
    assert "scd: error: config key 'task.rewards[0].args.url': reward 'remote': " + url in said, said[-3000:]
    assert "has not answered once" in said and "task.reward_start_timeout_s = 5" in said


# ---- an outage of the reward service, then a SIGKILL ------------------------------------------

OUTAGE_S = 30.0
START_TIMEOUT_S = 5


@pytest.fixture
def reward_service(tmp_path: Path) -> Any:
    service = RewardService(free_port(), tmp_path / "scored-before.jsonl")
    yield service
    service.stop()


def fetch(port: int, path: str) -> tuple[int, str]:
    """The status and body of ``path``; (0, "") while nothing listens on ``port`` yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()
    except urllib.error.URLError:
        return 0, ""


def metric(port: int, name: str) -> float:
    _, text = fetch(port, "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


# A second reward beside the remote one, an async judge that notes each completion it is paid for.
COUNTING = """
import json
import os
from pathlib import Path

async def judge(prompt, completion, answer, row):
    with (Path(__file__).parent / os.environ["COUNTED"]).open("a") as out:
        out.write(json.dumps({"row": row, "completion": completion}) + "\\n")
    return 1.0
"""


def counted(path: Path) -> Counter[int]:
    """The judge's calls by row id."""
    return Counter(orjson.loads(line)["row"]["id"] for line in path.read_bytes().splitlines()) if path.exists() \
        else Counter()


def test_a_reward_outage_then_a_sigkill_pays_each_reward_once_per_sibling_and_regenerates_nothing(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str, reward_service: RewardService) -> None:
    """Issue 51's done-when: the remote reward down ~30 s mid-run beside a counting judge, a checkpoint and a
    SIGKILL during the outage, a restore: each reward is paid once for every sibling, nothing regenerated."""
    port = free_port()
    dataset = write_dataset(tmp_path)
    (tmp_path / "counting_judge.py").write_text(COUNTING)
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, port=port, extra=(
        f'\n[[task.rewards]]\nfunction = "http"\nname = "remote"\n'
        f'args = {{ url = "{reward_service.url}", retries = 1, backoff_s = 0.1, timeout_s = 5.0 }}\n'
        '\n[[task.rewards]]\nfunction = "counting_judge:judge"\nname = "judge"\n'
        "\n[checkpointing]\nenabled = true\ninterval_s = 3600\nkeep_last = 5\n"))
    config.write_text(config.read_text().replace(
        'name = "reverse"\nsize = 64\n',
        f'name = "jsonl"\npath = "{dataset}"\nreward_start_timeout_s = {START_TIMEOUT_S}\n').replace(
        # The outage outlasts the stall limit many times over: waiting it out must not read as a stall.
        f"metrics_port = {port}\n", f"metrics_port = {port}\nstall_after_s = 5\nstall_after_steps = 1\n"))
    root = tmp_path / "out" / "checkpoints"
    reward_service.start()
    first = ScdProcess(config, env={"COUNTED": "counted-before.jsonl"})
    scd_processes.append(first)
    first.wait_for_line("step 3 ")

    reward_service.stop()
    down_at = time.monotonic()
    wait_until(lambda: fetch(port, "/readyz")[0] == 503 and "scoring has waited" in fetch(port, "/readyz")[1],
               OUTAGE_S - 10, "/readyz names the reward outage")
    # Alive, waiting: a liveness probe must not restart it.
    assert fetch(port, "/healthz") == (200, "ok\n")
    assert metric(port, "scd_reward_unavailable") == 1
    # Generation goes on to the window's end, its siblings waiting for their scores; then a checkpoint.
    time.sleep(5)
    first.signal(signal.SIGUSR1)
    first.wait_for_line("(signal)")
    [bundle] = layout.finalized_bundles(root)
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
    assert first.proc.poll() is None, "the run exited over a reward outage"
    assert fetch(port, "/healthz") == (200, "ok\n"), "an outage past the stall limit read as a stall"
    first.kill_group()  # SIGKILL while siblings wait for their scores
    # The remote reward is asked first: through the outage the judge was paid for nothing it did not answer.
    assert counted(tmp_path / "counted-before.jsonl") == Counter(i["row"]["id"] for i in reward_service.items())

    sidecar = decode(bundle / layout.SIDECAR_FILE, Sidecar)
    in_flight = {e.group_id: e for e in sidecar.ledger.entries if e.state == "in_flight"}
    finished: dict[str, dict[int, list[int]]] = {}
    for f in sidecar.finished_siblings:
        finished.setdefault(f.group_id, {})[f.index] = f.token_ids
    staged = {group_id: {index for index, _ in entry.staged} for group_id, entry in in_flight.items()}
    scores = Counter(s.group_id for s in sidecar.sibling_scores)
    complete = [g for g in in_flight if len(staged[g]) + len(finished.get(g, {})) == 8]
    owed = {g: 8 - scores[g] for g in complete}
    assert sum(owed.values()) > 0, "the checkpoint holds no complete group waiting for its scores"

    reward_service.log = tmp_path / "scored-after.jsonl"
    second = ScdProcess(config, env={"COUNTED": "counted-after.jsonl"})
    scd_processes.append(second)
    # Restarted while the service is still down: the run trained before, so its reward answered in an earlier
    # process, and it is waited for past task.reward_start_timeout_s, not refused with exit 2.
    wait_until(lambda: "scoring has waited" in fetch(port, "/readyz")[1], 240, "the restored run waits for the reward")
    time.sleep(START_TIMEOUT_S + 5)
    assert second.proc.poll() is None, second.output()[-3000:]
    assert fetch(port, "/healthz") == (200, "ok\n")
    reward_service.start()
    step = layout.step_of(bundle)
    assert step is not None
    second.wait_for_line(f"step {step + 4} ")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 0, second.output()[-3000:]

    events = [orjson.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_bytes().splitlines()]
    restore = [e for e in events if e["event"] == "restore"][-1]
    assert restore["siblings_rerun"] == 0
    assert restore["scores_reused"] == len(sidecar.sibling_scores)
    assert restore["scores_owed"] == sum(len(staged[g]) + len(finished.get(g, {})) for g in in_flight) - \
        len(sidecar.sibling_scores)
    # Each sibling of a complete group was scored once more if the bundle held no score for it, else never,
    # and none was generated again: the texts scored are the bundle's own.
    scored_after = Counter(item["row"]["id"] for item in reward_service.items())
    texts_after = Counter((item["row"]["id"], item["completion"]) for item in reward_service.items())
    policy = build_policy(parse_config({}, tmp_path).model, 0)
    for group_id, count in owed.items():
        row_id = int(group_id.removeprefix("e0-p"))
        assert scored_after[row_id] == count, group_id
        assert counted(tmp_path / "counted-after.jsonl")[row_id] == count, group_id
        for tokens in finished.get(group_id, {}).values():
            assert texts_after[(row_id, policy.decode(tokens))] >= 1, group_id
    # Every prompt in flight at the cut reached a terminal or in-flight state again in the last bundle.
    final = decode(layout.finalized_bundles(root)[-1] / layout.SIDECAR_FILE, Sidecar)
    states = {e.group_id: e.state for e in final.ledger.entries}
    assert all(states.get(g) in ("ready", "consumed", "in_flight") for g in in_flight)
    # After the restore too, each reward was paid as often as the other for every prompt.
    assert counted(tmp_path / "counted-after.jsonl") == scored_after
