"""Rewards: the built-ins on hand-made completions, Python rewards from the config's directory, weights
and parts, every way a reward can fail (stopping the run, or scoring 0 and counted), sync user code in
real worker processes (off the event loop, killed at its deadline, dying with scd), and the HTTP scorer
against a real server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from scd.config import TaskConfig, parse_config
from scd.errors import EXIT_OTHER, ConfigError, RewardError
from scd.rewards import RewardInput, RewardUnavailable, Scored, load_rewards, match_score
from tests.conftest import REPO, SCD, free_port


def task_config(*rewards: dict[str, Any], **keys: Any) -> TaskConfig:
    return parse_config({"task": {"rewards": list(rewards), **keys}}, Path.cwd()).task


def item(completion: str, answer: Any = "", *, prompt: Any = "p", prompt_id: int = 0,
         row: dict[str, Any] | None = None) -> RewardInput:
    return RewardInput(prompt_id=prompt_id, prompt=prompt, completion=completion, answer=answer, row=row or {},
                       where=f"task.jsonl:{prompt_id + 1}")


def write_module(directory: Path, source: str) -> str:
    """A module of reward functions in ``directory``, under a name no other test imported."""
    name = f"scd_test_rewards_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return name


async def scored(config: TaskConfig, items: list[RewardInput], base_dir: Path | None = None) -> list[Scored]:
    async with contextlib.aclosing(load_rewards(config, base_dir or Path.cwd())) as scorer:
        return await scorer.score(items)


def errors_counted(name: str, cause: str) -> float:
    return REGISTRY.get_sample_value("scd_reward_errors_total", {"name": name, "cause": cause}) or 0.0


# ---- configuration -----------------------------------------------------------------------------


async def test_no_rewards_configured_is_the_character_match_as_before() -> None:
    results = await scored(TaskConfig(), [item("1243", "1234"), item("4321", "1234")])
    assert results == [Scored(total=match_score("1243", "1234"), components={"match": 0.5}),
                       Scored(total=0.0, components={"match": 0.0})]


def test_the_fingerprint_counts_the_rewards_not_how_failures_are_handled(tmp_path: Path) -> None:
    default = parse_config({}, tmp_path)
    assert "rewards" not in default.fingerprint_fields()["task"]  # a bundle from before rewards keeps its fingerprint
    handled = parse_config({"task": {"reward_timeout_s": 5.0, "reward_errors": "zero"}}, tmp_path)
    assert handled.fingerprint() == default.fingerprint()
    exact = parse_config({"task": {"rewards": [{"function": "exact"}]}}, tmp_path)
    assert exact.fingerprint() != default.fingerprint()


@pytest.mark.parametrize(("task", "key"), [
    ({"rewards": [{"function": "exact", "weight": math.nan}]}, "task.rewards[0].weight"),
    ({"rewards": [{"weight": 1.0}]}, "task.rewards[0]"),
    ({"reward_timeout_s": 0.0}, "task.reward_timeout_s"),
    ({"reward_errors": "ignore"}, "task.reward_errors"),
    ({"reward_workers": 0}, "task.reward_workers"),
    ({"reward_workers": "many"}, "task.reward_workers"),
])
def test_a_bad_reward_setting_names_its_key(tmp_path: Path, task: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"task": task}, tmp_path)
    assert caught.value.key == key


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    directory = tmp_path_factory.mktemp("reward_modules")
    good = write_module(directory, "def reward(prompt, completion, answer, row):\n    return 1.0\n")
    broken = write_module(directory, "raise RuntimeError('broken at import')\n")
    return directory, {"good": good, "broken": broken}


@pytest.mark.parametrize(("rewards", "key"), [
    ([{"function": "scd_no_such_module:reward"}], "task.rewards[0].function"),
    ([{"function": "{broken}:reward"}], "task.rewards[0].function"),
    ([{"function": "exact"}, {"function": "{good}:missing"}], "task.rewards[1].function"),
    ([{"function": "mth"}], "task.rewards[0].function"),
    ([{"function": "{good}:reward", "args": {"bonus": 1}}], "task.rewards[0].args"),
    ([{"function": "exact", "args": {"strict": True}}], "task.rewards[0].args"),
    ([{"function": "regex"}], "task.rewards[0].args.pattern"),
    ([{"function": "regex", "args": {"pattern": "(unclosed"}}], "task.rewards[0].args.pattern"),
    ([{"function": "regex", "args": {"pattern": "x", "flags": "iq"}}], "task.rewards[0].args.flags"),
    ([{"function": "http"}], "task.rewards[0].args.url"),
    ([{"function": "http", "args": {"url": "ftp://127.0.0.1/score"}}], "task.rewards[0].args.url"),
    ([{"function": "http", "args": {"url": "http://127.0.0.1/score", "retry": 1}}], "task.rewards[0].args.retry"),
    ([{"function": "http", "args": {"url": "http://127.0.0.1/score", "batch_size": 0}}],
     "task.rewards[0].args.batch_size"),
    ([{"function": "exact"}, {"function": "exact"}], "task.rewards[1].name"),
    ([{"function": "exact", "name": "a/b"}], "task.rewards[0].name"),
    ([{"function": "no/such/file.py:reward"}], "task.rewards[0].function"),
    ([{"function": "{broken}.py:reward"}], "task.rewards[0].function"),
])
def test_a_reward_that_cannot_be_resolved_names_its_key(
        modules: tuple[Path, dict[str, str]], rewards: list[dict[str, Any]], key: str) -> None:
    directory, names = modules
    rewards = [{**r, "function": r["function"].format(**names)} for r in rewards]
    with pytest.raises(ConfigError) as caught:
        load_rewards(task_config(*rewards), directory)
    assert caught.value.key == key


def test_a_module_comes_from_the_config_directory_first_then_sys_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_dir, elsewhere = tmp_path / "config", tmp_path / "elsewhere"
    config_dir.mkdir()
    elsewhere.mkdir()
    name = write_module(elsewhere, "def reward(prompt, completion, answer, row):\n    return 0.0\n")
    (config_dir / f"{name}.py").write_text("def reward(prompt, completion, answer, row):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    load_rewards(task_config({"function": f"{name}:reward"}), config_dir)
    assert sys.modules[name].__file__ == str(config_dir / f"{name}.py")
    only_elsewhere = write_module(elsewhere, "def reward(prompt, completion, answer, row):\n    return 0.0\n")
    load_rewards(task_config({"function": f"{only_elsewhere}:reward"}), config_dir)
    assert str(config_dir) not in sys.path  # the config's directory was searched for the import only


async def test_a_module_may_be_a_file_relative_to_the_config_directory(tmp_path: Path) -> None:
    config_dir, rewards = tmp_path / "configs", tmp_path / "examples" / "task"
    config_dir.mkdir()
    rewards.mkdir(parents=True)
    (rewards / "helper.py").write_text("BONUS = 0.25\n")
    # Two files of one name are two modules; each imports what lies beside it.
    (rewards / "reward.py").write_text("from helper import BONUS\n\n"
                                       "def reward(prompt, completion, answer, row):\n    return 1.0 + BONUS\n")
    (config_dir / "reward.py").write_text("def reward(prompt, completion, answer, row):\n    return 0.0\n")
    config = task_config({"function": "../examples/task/reward.py:reward", "name": "file"},
                         {"function": "reward.py:reward", "name": "beside"})
    [result] = await scored(config, [item("x")], config_dir)
    assert result.components == {"file": 1.25, "beside": 0.0}
    assert str(rewards) not in sys.path


@pytest.mark.slow  # an `scd` subprocess
@pytest.mark.parametrize(("function", "said"), [
    ("scd_no_such_module:reward", "cannot import 'scd_no_such_module'"),
    ("{good}:missing", "has no function 'missing'"),
])
def test_scd_run_names_a_reward_that_does_not_resolve_and_exits_2_before_ray_starts(
        modules: tuple[Path, dict[str, str]], function: str, said: str) -> None:
    directory, names = modules
    config = directory / f"scd-{uuid.uuid4().hex[:6]}.toml"
    config.write_text(f'[[task.rewards]]\nfunction = "exact"\n\n[[task.rewards]]\n'
                      f'function = "{function.format(**names)}"\n')
    started = time.monotonic()
    out = subprocess.run([*SCD, "run", str(config)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "config key 'task.rewards[1].function'" in out.stderr and said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert "ray" not in out.stderr.lower() and time.monotonic() - started < 30


# ---- the built-ins -----------------------------------------------------------------------------


async def test_exact_compares_normalized_text() -> None:
    results = await scored(task_config({"function": "exact"}), [
        item("  The   Answer\n is 12 ", "the answer is 12"), item(" 12\t", 12), item("12.", 12), item("", "x"),
    ])
    assert [r.total for r in results] == [1.0, 1.0, 0.0, 0.0]


# Each answer with a right and a wrong boxed completion and a right unboxed final line.  Read as plain text
# first, an answer in LaTeX was its leading integer: 3\sqrt{2} was 3, 2^{10} was 2, 2\pi was 2.
MATH_ANSWERS = [
    (r"3\sqrt{2}", r"\boxed{3\sqrt{2}}", r"\boxed{3}", r"The final answer is $3\sqrt{2}$"),
    (r"2^{10}", r"\boxed{1024}", r"\boxed{2}", "The answer is 1024"),
    (r"2\pi", r"\boxed{2\pi}", r"\boxed{2}", r"Final answer: $2\pi$"),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", "The answer is 0.5"),
    ("0.75", r"so the ratio is $\boxed{3/4}$", r"$\boxed{2/3}$", "The answer is $3/4$"),
    (r"(1, 2]", r"\boxed{(1, 2]}", r"\boxed{[1, 2]}", r"The answer is $(1,2]$"),
    (r"[0, \infty)", r"\boxed{[0, \infty)}", r"\boxed{(0, \infty)}", r"The answer is $[0, \infty)$"),
    ("12", r"\boxed{12}", r"\boxed{13}", "The answer is 12"),
    (12, r"\boxed{12}", r"\boxed{1}", "Final answer: 12"),
]


@pytest.mark.parametrize(("answer", "right", "wrong", "final_line"), MATH_ANSWERS,
                         ids=[str(a[0]) for a in MATH_ANSWERS])
async def test_math_reads_the_answer_as_latex_and_verifies_the_final_answer(
        answer: Any, right: str, wrong: str, final_line: str) -> None:
    results = await scored(task_config({"function": "math"}), [
        item(f"Some work first.\n{right}", answer), item(f"Some work first.\n{wrong}", answer),
        item(f"Some work first.\n{final_line}", answer),
    ])
    assert [r.total for r in results] == [1.0, 0.0, 1.0]


async def test_math_counts_no_unanchored_number() -> None:
    # As open-r1's and TRL's accuracy rewards: the last number a completion mentions is not its answer.
    results = await scored(task_config({"function": "math"}), [
        item("we have 5 apples and 12 pears", 12), item("12", 12), item("I do not know", 12),
    ])
    assert [r.total for r in results] == [0.0, 0.0, 0.0]


async def test_match_takes_any_answer_as_text_and_an_empty_answer_matches_only_an_empty_completion() -> None:
    results = await scored(task_config({"function": "match"}), [
        item("1234", 1234), item("12", 1234), item("", ""), item("x", ""),
    ])
    assert [r.total for r in results] == [1.0, 0.5, 1.0, 0.0]


async def test_regex_rewards_the_format() -> None:
    think = {"function": "regex", "name": "think", "args": {"pattern": r"^<think>.+</think>", "flags": "s"}}
    loud = {"function": "regex", "name": "loud", "weight": 0.5, "args": {"pattern": "answer:", "flags": "i"}}
    results = await scored(task_config(think, loud), [
        item("<think>a\nb</think> ANSWER: 4"), item("no thinking, answer: 4"), item("<think></think>"),
    ])
    assert [r.components for r in results] == [{"think": 1.0, "loud": 1.0}, {"think": 0.0, "loud": 1.0},
                                               {"think": 0.0, "loud": 0.0}]
    assert [r.total for r in results] == [1.5, 0.5, 0.0]


# ---- Python rewards ----------------------------------------------------------------------------

CUSTOM = """
import os

import anyio
import orjson

CALLS = []

def sync_reward(prompt, completion, answer, row, log):
    # Runs in a worker process: what it was called with goes to a file, with the process it ran in.
    with open(log, "ab") as f:
        f.write(orjson.dumps(["sync", prompt, completion, answer, row, os.getpid()]) + b"\\n")
    return row["difficulty"] * 0.25

async def async_reward(prompt, completion, answer, row, bonus):
    await anyio.sleep(0)
    CALLS.append(["async", prompt, completion, answer, row, os.getpid()])
    return {"score": bonus if completion == answer["value"] else 0.0, "format": 1.0}

class AsyncJudge:
    async def __call__(self, prompt, completion, answer, row):
        await anyio.sleep(0)
        return 1.0

judge = AsyncJudge()

def verl_style(prompt, completion, answer, row):
    return {"score": 1, "acc": 1}

def no_score(prompt, completion, answer, row):
    return {"acc": 1.0}
"""


async def test_python_rewards_get_the_prompt_and_row_as_given_and_add_up_with_weights(tmp_path: Path) -> None:
    name = write_module(tmp_path, CUSTOM)
    log = tmp_path / "sync_calls.jsonl"
    config = task_config({"function": f"{name}:sync_reward", "weight": 2.0, "args": {"log": str(log)}},
                         {"function": f"{name}:async_reward", "name": "judge", "args": {"bonus": 0.5}})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    answer = {"value": "4", "units": None}
    row = {"difficulty": 3, "source": "gsm"}
    before = REGISTRY.get_sample_value("scd_reward_count", {"name": "judge/format"}) or 0.0
    results = await scored(config, [item("4", answer, prompt=messages, row=row),
                                    item("5", answer, prompt="plain text", row=row)], tmp_path)
    assert results[0] == Scored(total=2.0 * 0.75 + 0.5, components={"sync_reward": 0.75, "judge": 0.5,
                                                                     "judge/format": 1.0})
    assert results[1] == Scored(total=2.0 * 0.75 + 0.0, components={"sync_reward": 0.75, "judge": 0.0,
                                                                     "judge/format": 1.0})
    calls = [orjson.loads(line) for line in log.read_bytes().splitlines()] + sys.modules[name].CALLS
    assert sorted((c[:-1] for c in calls), key=repr) == sorted([
        ["sync", messages, "4", answer, row], ["async", messages, "4", answer, row],
        ["sync", "plain text", "5", answer, row], ["async", "plain text", "5", answer, row],
    ], key=repr)
    # The sync reward ran in a worker process, the async one on the event loop.
    assert {c[-1] for c in calls if c[0] == "sync"} != {os.getpid()}
    assert {c[-1] for c in calls if c[0] == "async"} == {os.getpid()}
    assert REGISTRY.get_sample_value("scd_reward_count", {"name": "judge/format"}) == before + 2


async def test_a_dicts_score_is_the_reward_and_its_other_keys_are_reported(tmp_path: Path) -> None:
    name = write_module(tmp_path, CUSTOM)
    [result] = await scored(task_config({"function": f"{name}:verl_style", "name": "verl", "weight": 2.0}),
                            [item("x")], tmp_path)
    assert result == Scored(total=2.0, components={"verl": 1.0, "verl/acc": 1.0})
    with pytest.raises(RewardError) as caught:
        await scored(task_config({"function": f"{name}:no_score"}), [item("x")], tmp_path)
    assert caught.value.cause == "malformed" and f"{name}:no_score" in str(caught.value)
    assert "without a 'score' key" in str(caught.value)


async def test_an_object_with_an_async_call_is_awaited(tmp_path: Path) -> None:
    name = write_module(tmp_path, CUSTOM)
    [result] = await scored(task_config({"function": f"{name}:judge"}), [item("x")], tmp_path)
    assert result == Scored(total=1.0, components={"judge": 1.0})


BAD = """
import math
import os
import time

import anyio

def raises(prompt, completion, answer, row):
    raise ValueError("no verdict")

def nan(prompt, completion, answer, row):
    return math.nan

def inf(prompt, completion, answer, row):
    return -math.inf

def text(prompt, completion, answer, row):
    return "1.0"

def boolean(prompt, completion, answer, row):
    return True

def nan_part(prompt, completion, answer, row):
    return {"score": 1.0, "correct": math.nan}

def exits(prompt, completion, answer, row):
    os._exit(3)

def sleeps(prompt, completion, answer, row):
    time.sleep(0.5)
    return 1.0

async def naps(prompt, completion, answer, row):
    await anyio.sleep(5)
    return 1.0
"""


@pytest.fixture(scope="module")
def bad_rewards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    directory = tmp_path_factory.mktemp("bad_rewards")
    return directory, write_module(directory, BAD)


@pytest.mark.parametrize("reward_errors", ["stop", "zero"])
@pytest.mark.parametrize(("function", "cause", "said"), [
    ("raises", "exception", "raised ValueError: no verdict"),
    ("nan", "not_finite", "returned nan"),
    ("inf", "not_finite", "returned -inf"),
    ("text", "not_a_number", "returned '1.0' (str), not a number"),
    ("boolean", "not_a_number", "returned True (bool), not a number"),
    ("nan_part", "not_finite", "part 'correct' returned nan"),
    ("exits", "crashed", "its worker process exited while scoring (exit code 3)"),
    ("sleeps", "timeout", "took longer than task.reward_timeout_s = 0.1 s"),
    ("naps", "timeout", "took longer than task.reward_timeout_s = 0.1 s"),
])
async def test_a_bad_reward_stops_the_run_naming_itself_or_scores_zero_and_is_counted(
        bad_rewards: tuple[Path, str], function: str, cause: str, said: str, reward_errors: str) -> None:
    directory, module = bad_rewards
    name = f"{function}-{reward_errors}"
    config = task_config({"function": f"{module}:{function}", "name": name}, {"function": "exact"},
                         # A short deadline only where the deadline is the subject: a loaded box's worker start
                         # (the crash's retry takes a fresh one) must not turn another failure into a timeout.
                         reward_timeout_s=0.1 if cause == "timeout" else 10.0, reward_errors=reward_errors)
    counted = errors_counted(name, cause)
    async with contextlib.aclosing(load_rewards(config, directory)) as scorer:
        if reward_errors == "stop":
            with pytest.raises(RewardError) as caught:
                await scorer.score([item("4", "4", prompt_id=7)])
            assert str(caught.value) == \
                f"reward {name!r} (function '{module}:{function}') failed on task.jsonl:8: {said}"
            assert (caught.value.cause, caught.value.prompt_id, caught.value.exit_code) == (cause, 7, EXIT_OTHER)
        else:
            [result] = await scorer.score([item("4", "4", prompt_id=7)])
            assert result == Scored(total=1.0, components={name: 0.0, "exact": 1.0})
            assert scorer.statistics().errors_zeroed == 1
        stats = scorer.statistics()
    assert (stats.errors, stats.timeouts) == (1, int(cause == "timeout"))
    assert errors_counted(name, cause) == counted + 1


# ---- sync user code in worker processes --------------------------------------------------------

BLOCKING = """
import os
import time
from pathlib import Path

def spins(prompt, completion, answer, row):
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        pass
    return 1.0

def sleeps(prompt, completion, answer, row):
    time.sleep(row["sleep_s"])
    return 1.0

def hangs(prompt, completion, answer, row):
    Path(row["pids"], str(os.getpid())).touch()
    time.sleep(3600)
    return 1.0
"""
# Backtracks for ever (each further "a" doubles the time) in C code that holds the interpreter lock.
CATASTROPHIC = {"function": "regex", "name": "catastrophic", "args": {"pattern": r"^(a+)+$"}}


async def ticking(gaps: list[float]) -> None:
    last = time.perf_counter()
    while True:
        await anyio.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def test_sync_rewards_and_a_catastrophic_regex_do_not_block_the_event_loop(tmp_path: Path) -> None:
    name = write_module(tmp_path, BLOCKING)
    config = task_config({"function": f"{name}:spins"}, {"function": f"{name}:sleeps"}, CATASTROPHIC,
                         reward_timeout_s=2.0, reward_errors="zero", reward_workers=2)
    gaps: list[float] = []
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        await scorer.score([item("warm", row={"sleep_s": 0.0})])  # the workers' start-up is not what is measured
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticking, gaps)
            results = await scorer.score([item("a" * 40 + "!", row={"sleep_s": 0.5}) for _ in range(2)])
            tg.cancel_scope.cancel()
        stats = scorer.statistics()
    assert [r.components for r in results] == [{"spins": 1.0, "sleeps": 1.0, "catastrophic": 0.0}] * 2
    assert stats.timeouts == 2 and stats.pool.killed == 2  # the regex, killed at its deadline
    assert len(gaps) > 100
    # On the loop (or a thread, holding the interpreter lock) the regex would stall it for its whole 2 s; here
    # four busy workers compete with the loop for the cores, nothing more.
    assert max(gaps) < 0.5


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_hung_reward_is_killed_at_its_deadline_and_the_builtins_score_on(tmp_path: Path) -> None:
    name = write_module(tmp_path, BLOCKING)
    pids = tmp_path / "pids"
    pids.mkdir()
    config = task_config({"function": f"{name}:hangs", "name": "hung"}, {"function": "exact"},
                         reward_timeout_s=0.5, reward_errors="zero", reward_workers=1)
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        results = await scorer.score([item("x", "x", row={"pids": str(pids)}) for _ in range(3)])
        stats = scorer.statistics()
    assert [r.components for r in results] == [{"hung": 0.0, "exact": 1.0}] * 3
    assert (stats.timeouts, stats.pool.killed, stats.pool.busy, stats.pool.queued) == (3, 3, 0, 0)
    hung = [int(p.name) for p in pids.iterdir()]
    assert len(hung) == 3 and not any(map(alive, hung))


async def test_a_rewards_deadline_counts_the_call_not_its_wait_for_a_worker(tmp_path: Path) -> None:
    name = write_module(tmp_path, BLOCKING)
    config = task_config({"function": f"{name}:sleeps"}, reward_timeout_s=0.5, reward_workers=3)
    async with contextlib.aclosing(load_rewards(config, tmp_path)) as scorer:
        await scorer.score([item("warm", row={"sleep_s": 0.0}) for _ in range(3)])
        seen: list[int] = []

        async def watch_the_queue() -> None:
            while True:
                seen.append(scorer.statistics().pool.queued)
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_the_queue)
            # Four rounds of 0.3 s calls on three workers: the last round waits 0.9 s before its call starts.
            results = await scorer.score([item("x", row={"sleep_s": 0.3}) for _ in range(12)])
            tg.cancel_scope.cancel()
    assert [r.total for r in results] == [1.0] * 12
    assert max(seen) == 9


WORKER_OWNER = """
import sys
from pathlib import Path

import anyio

from scd.config import parse_config
from scd.rewards import RewardInput, load_rewards

async def main(directory: Path) -> None:
    task = parse_config({"task": {"rewards": [{"function": "NAME:hangs"}], "reward_workers": 2}}, directory).task
    scorer = load_rewards(task, directory)
    row = {"pids": str(directory / "pids")}
    await scorer.score([RewardInput(0, "p", "c", "a", row, "task.jsonl:1"),
                        RewardInput(1, "p", "c", "a", row, "task.jsonl:2")])

anyio.run(main, Path(sys.argv[1]))
"""


def test_every_worker_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    name = write_module(tmp_path, BLOCKING)
    (tmp_path / "pids").mkdir()
    owner = tmp_path / "owner.py"
    owner.write_text(WORKER_OWNER.replace("NAME", name))
    process = subprocess.Popen([sys.executable, str(owner), str(tmp_path)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    try:
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "pids").iterdir())) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = [int(p.name) for p in (tmp_path / "pids").iterdir()]
        assert all(map(alive, workers))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers))


# ---- HTTP --------------------------------------------------------------------------------------


class RewardServer:
    """A remote scorer on 127.0.0.1: an item scores len(completion) / 10, or a score and a part when its row asks.

    ``mode`` makes it misbehave: "503" or "429" (with ``Retry-After: retry_after``, when set) for the first
    ``failures`` requests, "400", "short" (one reward too few), or "slow" (answers after a second)."""

    def __init__(self, *, mode: str = "ok", failures: int = 0, delay_s: float = 0.0, retry_after: str = "") -> None:
        self.mode, self.failures, self.delay_s, self.retry_after = mode, failures, delay_s, retry_after
        self.requests = self.answered = self.inflight = self.max_inflight = 0
        self.batch_sizes: list[int] = []
        self.arrivals: list[float] = []  # each request's time.monotonic()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/score", self._score)
        # No grace at shutdown: a request in flight is cut off, as when the process dies.
        self._runner = web.AppRunner(app, shutdown_timeout=0.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _score(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.arrivals.append(time.monotonic())
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            items = orjson.loads(await request.read())["items"]
            self.batch_sizes.append(len(items))
            await anyio.sleep(1.0 if self.mode == "slow" else self.delay_s)
            if self.mode in ("503", "429") and self.requests <= self.failures:
                return web.Response(status=int(self.mode),
                                    headers={"Retry-After": self.retry_after} if self.retry_after else {})
            if self.mode == "400":
                return web.Response(status=400, text="no such task")
            rewards: list[Any] = [{"score": 0.5, "b": 0.25} if i["row"].get("parts") else len(i["completion"]) / 10
                                  for i in items]
            if self.mode == "short":
                rewards.pop()
            self.answered += 1
            return web.Response(body=orjson.dumps({"rewards": rewards}), content_type="application/json")
        finally:
            self.inflight -= 1


@contextlib.asynccontextmanager
async def serving(server: RewardServer) -> AsyncIterator[RewardServer]:
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def http_config(url: str, reward_errors: str = "stop", **args: Any) -> TaskConfig:
    return task_config({"function": "http", "name": "remote", "args": {"url": url, "backoff_s": 0.01, **args}},
                       reward_errors=reward_errors)


async def test_http_scores_in_batches_with_the_items_fields() -> None:
    async with serving(RewardServer()) as server:
        items = [item("a" * n, {"n": n}, prompt=[{"role": "user", "content": "go"}], row={"parts": n == 3})
                 for n in range(1, 6)]
        results = await scored(http_config(server.url, batch_size=2), items)
    assert sorted(server.batch_sizes) == [1, 2, 2]
    assert [r.total for r in results] == [0.1, 0.2, 0.5, 0.4, 0.5]
    assert results[2].components == {"remote": 0.5, "remote/b": 0.25}


async def test_http_keeps_to_its_concurrency_limit_across_groups() -> None:
    async with serving(RewardServer(delay_s=0.05)) as server:
        async with contextlib.aclosing(load_rewards(http_config(server.url, batch_size=2, max_concurrency=3),
                                                    Path.cwd())) as scorer:
            results: list[list[Scored]] = [[], []]

            async def group(index: int) -> None:
                results[index] = await scorer.score([item("ab") for _ in range(10)])

            async with anyio.create_task_group() as tg:
                tg.start_soon(group, 0)
                tg.start_soon(group, 1)
    assert server.requests == 10
    assert 2 <= server.max_inflight <= 3
    assert [r.total for rs in results for r in rs] == [0.2] * 20


async def test_http_retries_a_server_that_answers_503_until_it_recovers() -> None:
    async with serving(RewardServer(mode="503", failures=2)) as server:
        async with contextlib.aclosing(load_rewards(http_config(server.url, retries=3), Path.cwd())) as scorer:
            [result] = await scorer.score([item("abc")])
            stats = scorer.statistics()
    assert result.total == pytest.approx(0.3)
    assert (server.requests, stats.http_retries, stats.calls) == (3, 2, 3)


async def test_http_retries_a_429_after_the_wait_its_retry_after_asks() -> None:
    async with serving(RewardServer(mode="429", failures=1, retry_after="1")) as server:
        async with contextlib.aclosing(load_rewards(http_config(server.url, retries=1), Path.cwd())) as scorer:
            [result] = await scorer.score([item("abc")])
            stats = scorer.statistics()
    assert result.total == pytest.approx(0.3)
    assert (server.requests, stats.http_retries) == (2, 1)
    assert server.arrivals[1] - server.arrivals[0] >= 0.95  # not backoff_s = 0.01


async def test_http_retries_of_batches_refused_together_spread_out() -> None:
    batches = 8
    async with serving(RewardServer(mode="503", failures=batches)) as server:
        config = http_config(server.url, batch_size=1, max_concurrency=batches, backoff_s=0.2)
        results = await scored(config, [item("a") for _ in range(batches)])
    assert [r.total for r in results] == [0.1] * batches
    first, retried = server.arrivals[:batches], server.arrivals[batches:]
    assert len(retried) == batches and max(first) - min(first) < 0.05
    # Without jitter every retry comes 0.2 s after its refusal, all at once; with it, within 0.1-0.3 s.
    assert max(retried) - min(retried) > 0.05


async def test_http_survives_a_server_restart_within_the_retry_budget() -> None:
    server = RewardServer(delay_s=0.2)
    await server.start()
    config = http_config(server.url, batch_size=2, max_concurrency=1, retries=6, backoff_s=0.05)

    async def restart() -> None:
        while not server.answered:
            await anyio.sleep(0.005)
        await server.stop()  # cuts off the next batch's request
        await anyio.sleep(0.3)
        await server.start()  # on the same port

    try:
        async with contextlib.aclosing(load_rewards(config, Path.cwd())) as scorer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(restart)
                results = await scorer.score([item("a" * n) for n in range(1, 7)])
            stats = scorer.statistics()
    finally:
        await server.stop()
    assert [r.total for r in results] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert stats.http_retries >= 1 and stats.errors == 0


@pytest.mark.parametrize("reward_errors", ["stop", "zero"])
async def test_a_dead_server_is_unavailable_not_a_reward_error_whatever_reward_errors_says(reward_errors: str) -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    async with contextlib.aclosing(load_rewards(http_config(url, reward_errors, retries=2), Path.cwd())) as scorer:
        with pytest.raises(RewardUnavailable) as caught:
            await scorer.score([item("a", prompt_id=3), item("b")])
        stats = scorer.statistics()
    assert caught.value.reward == "remote"
    assert url in str(caught.value) and "2 retries spent" in str(caught.value)
    assert (stats.calls, stats.http_retries, stats.errors, stats.errors_zeroed) == (3, 2, 0, 0)


async def test_a_server_too_slow_for_its_timeout_is_unavailable_after_its_retries() -> None:
    async with serving(RewardServer(mode="slow")) as server:
        with pytest.raises(RewardUnavailable) as caught:
            await scored(http_config(server.url, retries=1, timeout_s=0.2), [item("a"), item("b")])
    assert "did not answer within 0.2 s" in str(caught.value)
    assert server.requests == 2


@pytest.mark.parametrize(("mode", "cause", "requests"), [
    ("400", "http", 1), ("short", "malformed", 1),
])
async def test_http_fails_at_once_on_a_refusal_or_a_malformed_answer_and_retries_a_timeout(
        mode: str, cause: str, requests: int) -> None:
    async with serving(RewardServer(mode=mode)) as server:
        with pytest.raises(RewardError) as caught:
            await scored(http_config(server.url, retries=1, timeout_s=0.2), [item("a"), item("b")])
    assert caught.value.cause == cause and server.url in str(caught.value)
    assert server.requests == requests
