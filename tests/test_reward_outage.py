"""A reward's outage, waited out by the real scoring stage and a real eval: each reward is paid once per
completion however often the outage makes scd ask again, a user's reward can say its own service is down,
and a service that never answered is refused.  Every HTTP reward here is a real server on loopback (or a
loopback port nobody listens on)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from aiohttp import web

from scd.config import Config, parse_config
from scd.errors import ConfigError
from scd.evaluation import Evaluation, eval_prompts
from scd.generation import open_backend
from scd.model.policy import build_policy
from scd.model.prompts import RenderedPrompt
from scd.records import Completion, FinishReason
from scd.rewards import Scored, load_rewards
from scd.scoring import ScoringStage, SiblingToScore
from scd.tasks import Prompt
from scd.telemetry.events import Eval
from tests.conftest import free_port, tiny_config
from tests.support.reward_server import RewardService

GROUPS = 2
GROUP_SIZE = 8
WAIT_S = 60.0  # generous: the box is shared

# Each counting reward appends the completion it judged to its own file in the config's directory; the
# "down" ones raise RewardUnavailable while their flag file exists.
COUNTING = """
from pathlib import Path

from scd.rewards import RewardUnavailable

HERE = Path(__file__).parent


def note(kind, completion):
    with (HERE / f"{kind}.calls").open("a") as out:
        out.write(completion + "\\n")


async def judge(prompt, completion, answer, row):
    note("judge", completion)
    return 1.0


def sandbox(prompt, completion, answer, row):
    note("sandbox", completion)
    return 0.5


async def flaky_judge(prompt, completion, answer, row):
    if (HERE / "judge-down").exists():
        raise RewardUnavailable("the judge's endpoint refuses connections")
    note("flaky_judge", completion)
    return 1.0


def flaky_sandbox(prompt, completion, answer, row):
    if (HERE / "sandbox-down").exists():
        raise RewardUnavailable("no sandbox free")
    note("flaky_sandbox", completion)
    return 0.5
"""


def write_rewards(directory: Path) -> str:
    """The counting rewards as a module of ``directory`` under a name no other test imported."""
    name = f"outage_rewards_{os.urandom(4).hex()}"
    (directory / f"{name}.py").write_text(COUNTING)
    return name


def calls(directory: Path, kind: str) -> Counter[str]:
    path = directory / f"{kind}.calls"
    return Counter(path.read_text().splitlines()) if path.exists() else Counter()


def text(group: int, index: int) -> str:
    return f"{group}{index:02d}"


def siblings() -> list[SiblingToScore]:
    """GROUPS groups of GROUP_SIZE siblings, each decoding to a completion text of its own."""
    return [SiblingToScore(f"g{group}", group, index,
                           Completion([int(c) for c in text(group, index)], [0.0] * 3, FinishReason.EOS, 0))
            for group in range(GROUPS) for index in range(GROUP_SIZE)]


def decode(token_ids: Sequence[int]) -> str:
    return "".join(map(str, token_ids))


PROMPTS = [RenderedPrompt(Prompt(prompt_id=group, prompt=f"p{group}", answer="a", where=f"test:{group}",
                                 row={"group": group}), (1, 2), 3) for group in range(GROUPS)]


def http_reward(url: str, **args: Any) -> dict[str, Any]:
    return {"function": "http", "name": "remote",
            "args": {"url": url, "retries": 0, "backoff_s": 0.01, "timeout_s": 5.0, **args}}


async def wait_for(check: Any, what: str) -> None:
    with anyio.fail_after(WAIT_S):
        while not check():
            await anyio.sleep(0.05)


async def test_an_outage_asks_again_only_what_did_not_answer_so_each_reward_is_paid_once_per_sibling(
        tmp_path: Path) -> None:
    """An async judge and a sync reward beside an HTTP reward whose server refuses connections for a while:
    the stage asks again, several times, and every reward is still called exactly once per sibling."""
    module = write_rewards(tmp_path)
    service = RewardService(free_port(), tmp_path / "served.jsonl")
    task = parse_config({"task": {"rewards": [
        {"function": f"{module}:judge", "name": "judge"}, {"function": f"{module}:sandbox", "name": "sandbox"},
        http_reward(service.url)], "reward_workers": 1}}, tmp_path).task
    scored: dict[str, Scored] = {}
    try:
        async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
            stage = ScoringStage(scorer, PROMPTS, decode,
                                 lambda sibling, score: scored.setdefault(decode(sibling.completion.token_ids), score))
            await tg.start(stage.run, siblings())
            await wait_for(lambda: stage.statistics().unavailable, "the outage is reported")
            assert "reward 'remote'" in stage.statistics().unavailable and service.url in stage.statistics().unavailable
            # The batch is refused three times (its waits: 1 s, then 2 s) before the service comes up; the HTTP
            # reward is asked first, so meanwhile the others are paid nothing (the calls counted are its requests).
            await wait_for(lambda: scorer.statistics().calls >= 3, "three refused attempts")
            assert not scored and not calls(tmp_path, "judge") and not calls(tmp_path, "sandbox")
            await anyio.to_thread.run_sync(service.start)
            await wait_for(lambda: len(scored) == GROUPS * GROUP_SIZE, "every sibling scored")
            assert stage.statistics().unavailable == ""
            tg.cancel_scope.cancel()
    finally:
        service.stop()
    every = Counter(text(g, i) for g in range(GROUPS) for i in range(GROUP_SIZE))
    assert calls(tmp_path, "judge") == every
    assert calls(tmp_path, "sandbox") == every
    assert Counter(item["completion"] for item in service.items()) == every
    assert [s.total for s in scored.values()] == pytest.approx([1.0 + 0.5 + 0.3] * GROUPS * GROUP_SIZE)


async def test_a_python_reward_raising_reward_unavailable_is_asked_again_later_async_or_sync(
        tmp_path: Path) -> None:
    """A user's async judge and sync sandbox say their services are down by raising RewardUnavailable: the
    stage waits, naming both, and asks them again later; the reward beside them is paid once."""
    module = write_rewards(tmp_path)
    (tmp_path / "judge-down").touch()
    (tmp_path / "sandbox-down").touch()
    task = parse_config({"task": {"rewards": [
        {"function": f"{module}:judge", "name": "judge"}, {"function": f"{module}:flaky_judge", "name": "flaky"},
        {"function": f"{module}:flaky_sandbox", "name": "box"}], "reward_workers": 1}}, tmp_path).task
    scored: list[str] = []
    async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
        stage = ScoringStage(scorer, PROMPTS, decode,
                             lambda sibling, _: scored.append(decode(sibling.completion.token_ids)))
        await tg.start(stage.run, siblings())
        await wait_for(lambda: "reward 'flaky'" in stage.statistics().unavailable
                       and "reward 'box'" in stage.statistics().unavailable, "both outages are reported")
        why = stage.statistics().unavailable
        assert "the judge's endpoint refuses connections" in why and "no sandbox free" in why
        (tmp_path / "judge-down").unlink()
        await wait_for(lambda: "reward 'flaky'" not in stage.statistics().unavailable, "the judge answers")
        assert "reward 'box'" in stage.statistics().unavailable and not scored
        (tmp_path / "sandbox-down").unlink()
        await wait_for(lambda: len(scored) == GROUPS * GROUP_SIZE, "every sibling scored")
        assert stage.statistics().unavailable == ""
        tg.cancel_scope.cancel()
    every = Counter(text(g, i) for g in range(GROUPS) for i in range(GROUP_SIZE))
    assert calls(tmp_path, "judge") == every
    assert calls(tmp_path, "flaky_judge") == every
    assert calls(tmp_path, "flaky_sandbox") == every
    assert sorted(scored) == sorted(every)


EVAL_ROWS = 3
EVAL_SAMPLES = 2


async def test_an_eval_waits_out_a_reward_outage_paying_each_reward_once_per_sample(tmp_path: Path) -> None:
    """An eval (configs/tiny.toml's model on the torch backend) whose HTTP reward's server refuses for a
    while: it waits, and returns once the server is up, the judge beside it called once per sample."""
    module = write_rewards(tmp_path)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_bytes(b"".join(orjson.dumps({"prompt": f"{k}{k}{k}{k}", "answer": f"{k}" * 4, "id": k}) + b"\n"
                                  for k in range(EVAL_ROWS)))
    service = RewardService(free_port(), tmp_path / "served.jsonl")
    config = tiny_config(tmp_path, "unused", eval={"path": str(held_out), "samples_per_prompt": EVAL_SAMPLES},
                         task={"name": "jsonl", "path": str(held_out),
                               "rewards": [{"function": f"{module}:judge", "name": "judge"},
                                           http_reward(service.url)]})
    policy = build_policy(config.model, config.run.seed)
    prompts = await anyio.to_thread.run_sync(eval_prompts, config, policy)
    evaluated: list[Eval] = []
    try:
        async with contextlib.aclosing(load_rewards(config.task, tmp_path)) as scorer:
            backend = await open_backend(config, policy)
            try:
                async with anyio.create_task_group() as tg:
                    async def evaluate() -> None:
                        evaluated.append(await Evaluation(config, prompts, backend, scorer, policy).run(0, 0))

                    tg.start_soon(evaluate)
                    await wait_for(lambda: scorer.statistics().calls >= 2, "two refused attempts")
                    assert "reward 'remote'" in scorer.outage().why and not evaluated
                    await anyio.to_thread.run_sync(service.start)
            finally:
                await backend.aclose()
    finally:
        service.stop()
    [event] = evaluated
    assert event.step == 0 and event.prompts == EVAL_ROWS and event.samples_per_prompt == EVAL_SAMPLES
    assert set(event.reward_components) == {"judge", "remote"} and event.reward_components["judge"] == 1.0
    judged = calls(tmp_path, "judge")
    assert sum(judged.values()) == EVAL_ROWS * EVAL_SAMPLES
    assert Counter(item["completion"] for item in service.items()) == judged


async def test_a_service_that_never_answered_is_refused_after_the_start_timeout_one_that_answered_is_waited_for(
        tmp_path: Path) -> None:
    """task.reward_start_timeout_s: a URL nobody listens on is refused (ConfigError, exit 2) naming the reward's
    key and URL; a service that answered once and then went down is waited for past that timeout."""
    nobody = f"http://127.0.0.1:{free_port()}/score"
    task = parse_config({"task": {"rewards": [http_reward(nobody)], "reward_start_timeout_s": 1.0}}, tmp_path).task
    async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer:
        stage = ScoringStage(scorer, PROMPTS, decode, lambda *_: None)
        with anyio.fail_after(WAIT_S), pytest.RaisesGroup(ConfigError, flatten_subgroups=True) as refused:
            await stage.run(siblings())
    message = str(refused.value.exceptions[0])
    assert "config key 'task.rewards[0].args.url'" in message and nobody in message
    assert "has not answered once" in message and "task.reward_start_timeout_s = 1" in message

    service = RewardService(free_port(), tmp_path / "served.jsonl")
    task = parse_config({"task": {"rewards": [http_reward(service.url)], "reward_start_timeout_s": 1.0}},
                        tmp_path).task
    first, second = siblings()[:GROUP_SIZE], siblings()[GROUP_SIZE:]
    scored: list[SiblingToScore] = []
    try:
        await anyio.to_thread.run_sync(service.start)
        async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
            stage = ScoringStage(scorer, PROMPTS, decode, lambda sibling, _: scored.append(sibling))
            await tg.start(stage.run, first)
            await wait_for(lambda: len(scored) == GROUP_SIZE, "the first group scored")
            await anyio.to_thread.run_sync(service.stop)
            for sibling in second:
                stage.submit(sibling)
            # Refused (retries at 1 s, then 2 s) for longer than the start timeout, and still waiting.
            await wait_for(lambda: scorer.outage().seconds > 2.5, "an outage past the start timeout")
            await anyio.to_thread.run_sync(service.start)
            await wait_for(lambda: len(scored) == GROUPS * GROUP_SIZE, "the second group scored")
            tg.cancel_scope.cancel()
    finally:
        service.stop()


async def test_a_run_resumed_past_step_0_waits_for_a_service_down_at_its_start_past_the_start_timeout(
        tmp_path: Path) -> None:
    """A restart during an outage: the run trained before, so its reward answered in an earlier process, and
    the outage is waited out, not refused with exit 2 (which systemd would not restart)."""
    nobody = f"http://127.0.0.1:{free_port()}/score"
    task = parse_config({"task": {"rewards": [http_reward(nobody)], "reward_start_timeout_s": 1.0}}, tmp_path).task
    async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
        stage = ScoringStage(scorer, PROMPTS, decode, lambda *_: None)
        assert stage.resumed(3, reward_changes={}) == ["remote"]
        await tg.start(stage.run, siblings())
        await wait_for(lambda: scorer.outage().seconds > 2.5, "an outage past the start timeout")
        assert nobody in stage.statistics().unavailable
        tg.cancel_scope.cancel()


async def test_a_run_resumed_under_a_changed_reward_set_refuses_a_new_rewards_wrong_url_and_waits_for_the_rest(
        tmp_path: Path) -> None:
    """A restore that changes the reward set: the reward still at its URL answered in an earlier process (a
    reweighting changes no service), so its outage is waited out; one the restore moved to another URL, or
    added, never answered this run, and a wrong URL of its is refused after task.reward_start_timeout_s (exit
    2) instead of waiting for ever."""
    judge, verifier, moved, added = (f"http://127.0.0.1:{free_port()}/score" for _ in range(4))

    def config(rewards: list[dict[str, Any]]) -> Config:
        return parse_config({"task": {"rewards": rewards, "reward_start_timeout_s": 1.0}}, tmp_path)

    saved = config([{**http_reward(judge), "name": "judge"}, {**http_reward(verifier), "name": "verifier"}])
    now = config([{**http_reward(judge), "name": "judge", "weight": 2.0}, {**http_reward(moved), "name": "verifier"},
                  {**http_reward(added), "name": "added"}])
    changes = now.fingerprint_changes(orjson.loads(orjson.dumps(saved.fingerprint_fields())))
    assert "task.rewards[0].weight" in changes and "task.rewards[1].args.url" in changes
    async with contextlib.aclosing(load_rewards(now.task, tmp_path)) as scorer:
        stage = ScoringStage(scorer, PROMPTS, decode, lambda *_: None)
        assert stage.resumed(0, changes) == []  # a bundle of step 0 trained on no answer
        assert stage.resumed(3, changes) == ["judge"]
        with anyio.fail_after(WAIT_S), pytest.RaisesGroup(ConfigError, flatten_subgroups=True) as refused:
            await stage.run(siblings())
    # Whichever of the two new URLs is refused first; never the judge's.
    message = str(refused.value.exceptions[0])
    refused_keys = {key for key, url in (("task.rewards[1]", moved), ("task.rewards[2]", added))
                    if f"config key '{key}.args.url'" in message and url in message}
    assert len(refused_keys) == 1, message
    assert "has not answered once" in message and judge not in message


async def test_the_http_sub_batches_that_answered_are_not_asked_again(tmp_path: Path) -> None:
    """A batch goes out in requests of ``batch_size``; the server refuses the first (503) and answers the
    others: the retry sends only the refused request's completions."""
    answered: Counter[str] = Counter()
    requests: list[int] = []

    async def score(request: web.Request) -> web.Response:
        items = orjson.loads(await request.read())["items"]
        requests.append(len(items))
        if len(requests) == 1:
            return web.Response(status=503)
        answered.update(item["completion"] for item in items)
        return web.json_response({"rewards": [0.5] * len(items)})

    app = web.Application()
    app.router.add_post("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/score"
    task = parse_config({"task": {"rewards": [http_reward(url, batch_size=4)]}}, tmp_path).task
    scored: list[str] = []
    try:
        async with contextlib.aclosing(load_rewards(task, tmp_path)) as scorer, anyio.create_task_group() as tg:
            stage = ScoringStage(scorer, PROMPTS, decode,
                                 lambda sibling, _: scored.append(decode(sibling.completion.token_ids)))
            await tg.start(stage.run, siblings())
            await wait_for(lambda: len(scored) == GROUPS * GROUP_SIZE, "every sibling scored")
            tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()
    # One batch of 16 in four requests of 4, the first refused, then that request's 4 once more.
    assert requests == [4] * 5
    assert answered == Counter(text(g, i) for g in range(GROUPS) for i in range(GROUP_SIZE))
