"""Dataset prompts: JSONL and Parquet rows, field mapping, chat templates, the prompt length limit.

Tokenizers are the real ones `scd model init-tiny` writes; the run-level checks go through a real
`scd run` and the real controller.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from prometheus_client import REGISTRY

from scd.config import Config, TaskConfig, parse_config
from scd.daemon import Controller
from scd.errors import ConfigError, RewardError
from scd.generation.base import GroupRequest
from scd.model.init_tiny import CHAT_CHARACTERS, ROLE_TOKENS, VOCABULARY, write_tokenizer
from scd.model.policy import ALPHABET, SPECIAL_TOKENS, UNK, HFPolicy, TinyPolicy, build_policy
from scd.model.prompts import RenderedPrompt, render_task
from scd.records import Completion, FinishReason
from scd.rewards import RewardInput, load_rewards
from scd.scoring import ScoringStage, SiblingToScore
from scd.tasks import build_task
from tests.conftest import ScdProcess, tiny_config

CHAT = [{"role": "user", "content": "What is 12+30? Answer with digits only."}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer `scd model init-tiny` writes (no weights: rendering needs none)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    (directory / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 128}')
    return directory


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def config_for(tmp_path: Path, model: Path | str = "tiny", **task: object) -> Config:
    return parse_config({"run": {"output_dir": str(tmp_path / "out")}, "model": {"name": str(model)},
                         "task": task}, tmp_path)


def rendered_ids(config: Config) -> list[tuple[int, ...]]:
    return [p.token_ids for p in render_task(config, build_policy(config.model, 0)).prompts]


def test_init_tiny_keeps_every_token_id_and_covers_chat_text(tokenizer_dir: Path) -> None:
    policy = HFPolicy(config_for(tokenizer_dir, tokenizer_dir).model)
    tokenizer = policy.tokenizer
    # The tiny policy's alphabet keeps the ids it always had, so the built-in tasks tokenize as before.
    assert [tokenizer.convert_tokens_to_ids(ch) for ch in ALPHABET] == \
        list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(ALPHABET)))
    assert len(tokenizer) == len(VOCABULARY)
    text = "".join(sorted(set(ALPHABET + CHAT_CHARACTERS)))
    assert UNK not in policy.encode_answer(text) and policy.decode(policy.encode_answer(text)) == text
    # Each role marker is one special token, dropped from decoded completions.
    assert all(len(policy.encode_answer(role)) == 1 for role in ROLE_TOKENS)
    assert policy.decode(policy.encode_answer("<|user|>\nhi")) == "\nhi"
    assert policy.chat_template == tokenizer.chat_template and "add_generation_prompt" in policy.chat_template


def test_chat_prompts_are_the_ids_apply_chat_template_gives(tmp_path: Path, tokenizer_dir: Path) -> None:
    rows = [{"prompt": CHAT, "answer": "42"},
            {"prompt": "Reverse 'abc'.", "answer": "cba"},
            {"prompt": [{"role": "system", "content": "Row's own."}, *CHAT], "answer": 42}]
    task = write_jsonl(tmp_path / "task.jsonl", rows)
    config = config_for(tmp_path, tokenizer_dir, name="jsonl", path=str(task), system_prompt="Be brief.")
    tokenizer = HFPolicy(config.model).tokenizer
    system = [{"role": "system", "content": "Be brief."}]
    expected = [tokenizer.apply_chat_template(system + messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
                for messages in (CHAT, [{"role": "user", "content": "Reverse 'abc'."}], rows[2]["prompt"])]
    assert rendered_ids(config) == [tuple(ids) for ids in expected]
    text = tokenizer.decode(expected[1])
    assert text == "<s><|system|>\nBe brief.\n<|user|>\nReverse 'abc'.\n<|assistant|>\n"

    # A Jinja file of the user's own replaces the tokenizer's template.
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    config = config_for(tmp_path, tokenizer_dir, name="jsonl", path=str(task), chat_template="plain.jinja")
    assert config.task.chat_template == str(template)
    first = rendered_ids(config)[0]
    assert tokenizer.decode(first) == f"user: {CHAT[0]['content']}\nassistant:"
    # "none": text prompts are raw text, as the built-ins are; chat prompts are refused.
    config = config_for(tmp_path, tokenizer_dir, name="jsonl", path=str(task), chat_template="none")
    with pytest.raises(ConfigError, match=rf"task\.chat_template.*{task}:1: the prompt is chat messages.*\"none\""):
        rendered_ids(config)


def test_builtin_prompts_stay_raw_text_under_a_tokenizer_with_a_template(tmp_path: Path,
                                                                         tokenizer_dir: Path) -> None:
    config = config_for(tmp_path, tokenizer_dir)
    policy = HFPolicy(config.model)
    prompts = build_task(config.task)
    assert rendered_ids(config) == [tuple(policy.encode_prompt(p.prompt)) for p in prompts]  # type: ignore[arg-type]
    assert len(rendered_ids(config)[0]) == config.task.max_digits + 2  # BOS, the digits, "="
    tiny = TinyPolicy(config_for(tmp_path).model, 0)
    assert rendered_ids(config_for(tmp_path)) == [tuple(tiny.encode_prompt(p.prompt)) for p in prompts]  # type: ignore[arg-type]


def test_rows_map_fields_and_keep_their_other_columns(tmp_path: Path) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [
        {"question": "1+1=", "solution": {"value": 2}, "level": 3, "tags": ["easy"]},
        {"question": "12=", "solution": "21", "level": 1},
    ])
    config = config_for(tmp_path, name="jsonl", path=str(task), prompt_field="question", answer_field="solution")
    prompts = build_task(config.task)
    assert [(p.prompt, p.answer, p.row, p.where) for p in prompts] == [
        ("1+1=", {"value": 2}, {"level": 3, "tags": ["easy"]}, f"{task}:1"),
        ("12=", "21", {"level": 1}, f"{task}:2"),
    ]
    # Every completion's budget is generation.max_new_tokens, whatever its answer: it may write before answering.
    rendered = render_task(config, build_policy(config.model, 0)).prompts
    assert [p.max_tokens for p in rendered] == [config.generation.max_new_tokens] * 2


def test_a_parquet_task_reads_chat_prompts_and_names_rows(tmp_path: Path, tokenizer_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "task.parquet"
    pq.write_table(pa.table({"prompt": [CHAT, [{"role": "user", "content": "Sort 'cab'."}]],
                             "answer": [42, None], "source": ["gsm", "made-up"]}), path)
    config = config_for(tmp_path, tokenizer_dir, name="parquet", path=str(path))
    prompts = build_task(config.task)
    assert [(p.prompt, p.answer, p.row, p.where) for p in prompts] == [
        (CHAT, 42, {"source": "gsm"}, f"{path}:row 0"),
        ([{"role": "user", "content": "Sort 'cab'."}], None, {"source": "made-up"}, f"{path}:row 1"),
    ]
    tokenizer = HFPolicy(config.model).tokenizer
    assert rendered_ids(config)[0] == tuple(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                          return_dict=False))
    path.write_text("not parquet")
    with pytest.raises(ConfigError, match=rf"task\.path.*{path}: not a Parquet file"):
        build_task(config.task)
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["b", "c"]}), path)
    with pytest.raises(ConfigError, match=rf"task\.prompt_field.*{path}:row 1: 'prompt' must be a string"):
        build_task(config.task)


# A sync reward that scores 1 when the row reached it as a Parquet writer's decimal and binary columns promise.
ROW_READER = """
import base64
from decimal import Decimal

def reads_the_row(prompt, completion, answer, row):
    return float(Decimal(answer) == Decimal("3.10") and base64.b64decode(row["blob"]) == b"\\x00\\xff"
                 and row["when"] == "2024-01-02" and row["parts"] == [{"price": "0.5"}])
"""


async def test_parquet_decimal_and_binary_columns_reach_sync_rewards_as_json(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "task.parquet"
    parts = pa.list_(pa.struct([("price", pa.decimal128(4, 1))]))
    pq.write_table(pa.table({"prompt": ["1="], "answer": pa.array([Decimal("3.10")], pa.decimal128(5, 2)),
                             "blob": pa.array([b"\x00\xff"], pa.binary()),
                             "when": pa.array([datetime.date(2024, 1, 2)], pa.date32()),
                             "parts": pa.array([[{"price": Decimal("0.5")}]], parts)}), path)
    (tmp_path / "row_reader.py").write_text(ROW_READER)
    config = config_for(tmp_path, name="parquet", path=str(path), rewards=[
        {"function": "row_reader.py:reads_the_row", "name": "row"}, {"function": "exact"}])
    [prompt] = build_task(config.task)
    # Exact text for a decimal, base64 for bytes, ISO 8601 for a date: what a sync reward, an async one and an
    # HTTP scorer all receive alike.
    assert (prompt.answer, prompt.row) == ("3.10", {"blob": "AP8=", "when": "2024-01-02", "parts": [{"price": "0.5"}]})
    async with contextlib.aclosing(load_rewards(config.task, tmp_path)) as scorer:
        [scored] = await scorer.score([RewardInput(prompt.prompt_id, prompt.prompt, "3.10", prompt.answer, prompt.row,
                                                   prompt.where)])
        stats = scorer.statistics()
    assert scored.components == {"row": 1.0, "exact": 1.0}
    assert (stats.errors, stats.pool.killed) == (0, 0)


def test_a_parquet_column_no_reward_could_receive_is_refused_naming_row_column_and_type(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "task.parquet"
    pq.write_table(pa.table({"prompt": ["1=", "2="], "answer": ["1", "2"],
                             "took": pa.array([None, datetime.timedelta(seconds=3)], pa.duration("s"))}), path)
    with pytest.raises(ConfigError, match=rf"'task\.path': {path}:row 1: column 'took' holds "
                                          r"datetime\.timedelta\(seconds=3\) \(Arrow type duration\[s\]\)"):
        build_task(TaskConfig(name="parquet", path=str(path)))


FAILS_ON_THREE = """
def fails_on_three(prompt, completion, answer, row):
    if row["n"] == 3:
        raise ValueError("no three")
    return 1.0
"""


async def test_a_reward_error_names_the_prompts_file_and_line(tmp_path: Path) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": f"{n}=", "answer": str(n), "n": n} for n in range(5)])
    (tmp_path / "fails.py").write_text(FAILS_ON_THREE)
    config = config_for(tmp_path, name="jsonl", path=str(task), reward_workers=1,
                        rewards=[{"function": "fails.py:fails_on_three", "name": "picky"}])
    prompts = [RenderedPrompt(prompt, (1,), 4) for prompt in build_task(config.task)]
    finished = [SiblingToScore(f"g{n}", n, 0, Completion([1], [0.0], FinishReason.EOS, 0)) for n in (1, 3)]
    async with contextlib.aclosing(load_rewards(config.task, tmp_path)) as scorer:
        stage = ScoringStage(scorer, prompts, lambda token_ids: "x", lambda sibling, scored: None)
        with anyio.fail_after(60), pytest.raises(ExceptionGroup) as caught:  # the stage's task groups
            await stage.run(finished)
    # Row n = 3 is the file's fourth line, as a load error would name it.
    assert caught.group_contains(RewardError, match=rf"^reward 'picky' \(function 'fails.py:fails_on_three'\) failed "
                                                    rf"on {task}:4: raised ValueError: no three$")


NOT_A_PROMPT = "'prompt' must be a string or a non-empty list"


@pytest.mark.parametrize(("line", "key", "says"), [
    ('{"prompt": "1=", "answer": "1"', "task.path", "not JSON: unexpected end of data"),
    ('["1=", "1"]', "task.path", "a row must be an object of columns, got list"),
    ('{"text": "1=", "answer": "1"}', "task.prompt_field", r"no 'prompt' field \(the row has \['answer', 'text'\]\)"),
    ('{"prompt": "1="}', "task.answer_field", "no 'answer' field"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', "task.prompt_field", NOT_A_PROMPT),
    ('{"prompt": [], "answer": "1"}', "task.prompt_field", NOT_A_PROMPT),
])
def test_a_bad_jsonl_row_is_refused_naming_its_line(tmp_path: Path, line: str, key: str, says: str) -> None:
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "12=", "answer": "21"}\n\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"'{key}': {task}:3: {says}"):
        build_task(TaskConfig(name="jsonl", path=str(task)))


def test_overlong_prompts_are_refused_or_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": "1" * n + "=", "answer": "1"} for n in (4, 60, 5, 47)])
    refuse = config_for(tmp_path, name="jsonl", path=str(task))
    # The tiny model's 64 positions, less generation.max_new_tokens = 16, leave 48: BOS, 47 digits and "=" is 49.
    with pytest.raises(ConfigError, match=rf"task\.max_prompt_tokens.*{task}:2: the prompt is 62 tokens, longer "
                                          r"than the 48 allowed \(the model's context of 64 minus "
                                          r"generation\.max_new_tokens = 16\)"):
        render_task(refuse, build_policy(refuse.model, 0))
    drop = config_for(tmp_path, name="jsonl", path=str(task), overlong_prompts="drop")
    with caplog.at_level(logging.WARNING, logger="scd.model.prompts"):
        rendered = render_task(drop, build_policy(drop.model, 0))
    assert rendered.dropped_overlong == 2
    assert [(p.prompt.prompt_id, p.prompt.where) for p in rendered.prompts] == [(0, f"{task}:1"), (1, f"{task}:3")]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "left out 2 prompts longer than 48 tokens" in warning and f"the first at {task}:2" in warning
    explicit = config_for(tmp_path, name="jsonl", path=str(task), max_prompt_tokens=6, overlong_prompts="drop")
    assert [p.prompt.where for p in render_task(explicit, build_policy(explicit.model, 0)).prompts] == [f"{task}:1"]


def test_the_prompt_limit_leaves_room_for_the_completion(tmp_path: Path, tokenizer_dir: Path) -> None:
    from scd.model.prompts import prompt_limit

    policy = HFPolicy(config_for(tokenizer_dir, tokenizer_dir).model)
    config = config_for(tmp_path, tokenizer_dir)
    assert prompt_limit(config, policy).tokens == 128 - 16  # max_position_embeddings of init-tiny's config
    vllm = parse_config({"model": {"name": str(tokenizer_dir)}, "generation": {
        "backend": "vllm", "max_new_tokens": 8, "vllm": {"max_model_len": 64}}}, tmp_path)
    limit = prompt_limit(vllm, policy)
    assert (limit.tokens, limit.why) == (56, "generation.vllm.max_model_len of 64 minus generation.max_new_tokens = 8")
    too_long = config_for(tmp_path, tokenizer_dir, max_prompt_tokens=113)
    with pytest.raises(ConfigError, match=r"task\.max_prompt_tokens.*113 tokens of prompt and generation\.max_new_"
                                          r"tokens = 16 do not fit the model's context of 128"):
        prompt_limit(too_long, policy)


def test_unknown_characters_are_counted_and_named_once(tmp_path: Path, tokenizer_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": "naïve ~", "answer": "ok"},
                                                 {"prompt": "fine", "answer": "é"}, {"prompt": "~", "answer": "x"}])
    for model in ("tiny", tokenizer_dir):
        config = config_for(tmp_path, model, name="jsonl", path=str(task), chat_template="none")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="scd.model.prompts"):
            render_task(config, build_policy(config.model, 0))
        [warning] = [r.getMessage() for r in caplog.records]
        # Two in the first prompt, one in the second's answer, one in the third prompt.
        assert warning.startswith("4 tokens of the task's prompts and answers are the tokenizer's unknown token, "
                                  f"the first at {task}:1; the characters: '~', 'é', 'ï'"), (model, warning)


def test_the_docs_say_which_characters_the_tiny_tokenizers_know() -> None:
    said = " ".join((Path(__file__).parents[1] / "docs" / "own-task.md").read_text().split())
    digits, lower, upper = "0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    assert ALPHABET == f"{digits}{lower}+-*=,.:;()[] "
    assert "knows `0-9`, `a-z`, `+-*=,.:;()[]` and space" in said
    assert CHAT_CHARACTERS == f"{upper}/?!'\"<>|_\n" and set(VOCABULARY) >= set(ROLE_TOKENS)
    assert "adds `A-Z`, `/?!'\"<>|_` and newline, and a token for each chat role" in said


def test_prompt_keys_are_checked_where_they_are_set(tmp_path: Path, tokenizer_dir: Path) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": "12=", "answer": "21"}])
    for key, value in (("system_prompt", "Be brief."), ("chat_template", "none"), ("prompt_field", "q")):
        with pytest.raises(ConfigError, match=rf"task\.{key}.*built-in task 'reverse' is raw text"):
            config_for(tmp_path, **{key: value})
    with pytest.raises(ConfigError, match=r"task\.chat_template.*missing\.jinja is not a file"):
        config_for(tmp_path, name="jsonl", path=str(task), chat_template="missing.jinja")
    with pytest.raises(ConfigError, match=r"task\.prompt_field.*two column names"):
        config_for(tmp_path, name="jsonl", path=str(task), answer_field="prompt")
    with pytest.raises(ConfigError, match=r"task\.max_prompt_tokens.*must be >= 0"):
        config_for(tmp_path, max_prompt_tokens=-1)
    # A system prompt needs a template to reach the model; the tiny model has no tokenizer to apply one.
    no_template = config_for(tmp_path, name="jsonl", path=str(task), system_prompt="Be brief.", chat_template="none")
    with pytest.raises(ConfigError, match=r"task\.system_prompt.*none applies \(task\.chat_template = \"none\"\)"):
        rendered_ids(no_template)
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    tiny = config_for(tmp_path, name="jsonl", path=str(task), chat_template="t.jinja")
    with pytest.raises(ConfigError, match=r"task\.chat_template.*'tiny' has no tokenizer"):
        rendered_ids(tiny)
    broken = config_for(tmp_path, tokenizer_dir, name="jsonl", path=str(task), chat_template="t.jinja")
    (tmp_path / "t.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ConfigError, match=rf"task\.chat_template.*{task}:1: the chat template failed: no system"):
        rendered_ids(broken)


def test_the_fingerprint_counts_prompt_keys_only_when_set(tmp_path: Path) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": "12=", "answer": "21"}])
    plain = config_for(tmp_path, name="jsonl", path=str(task))
    # A config that sets none of them keeps the fingerprint it had before they existed: bundles restore.
    assert set(plain.fingerprint_fields()["task"]) == {"name", "seed", "size", "min_digits", "max_digits", "path"}
    assert "task.chat_template_sha256" not in plain.fingerprint_fields()
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    fingerprints = {plain.fingerprint()}
    for key, value in (("prompt_field", "q"), ("answer_field", "a"), ("system_prompt", "Be brief."),
                       ("chat_template", "none"), ("chat_template", "t.jinja"), ("max_prompt_tokens", 20),
                       ("overlong_prompts", "drop")):
        fingerprints.add(config_for(tmp_path, name="jsonl", path=str(task), **{key: value}).fingerprint())
    assert len(fingerprints) == 8
    with_template = config_for(tmp_path, name="jsonl", path=str(task), chat_template="t.jinja")
    before = with_template.fingerprint()
    template.write_text("{{ messages[-1]['content'] }}")
    assert with_template.fingerprint() != before


@pytest.mark.slow  # an `scd` subprocess
def test_scd_run_refuses_an_overlong_prompt_and_a_line_that_is_not_json(tmp_path: Path) -> None:
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": "12=", "answer": "21"}] * 2 +
                       [{"prompt": "1" * 59 + "=", "answer": "1"}])
    config = tmp_path / "scd.toml"
    config.write_text('[run]\noutput_dir = "out"\n[telemetry]\nmetrics_port = 0\n'
                      '[task]\nname = "jsonl"\npath = "task.jsonl"\n')
    run = ScdProcess(config)
    assert run.wait(timeout=120) == 2, run.output()
    assert (f"scd: error: config key 'task.max_prompt_tokens': {task}:3: the prompt is 61 tokens, longer than the "
            "48 allowed") in run.output()
    with task.open("a") as f:
        f.write('{"prompt": "12=", "answer": 21,}\n')
    config.write_text(config.read_text() + 'overlong_prompts = "drop"\n')
    run = ScdProcess(config)
    assert run.wait(timeout=120) == 2, run.output()
    assert f"scd: error: config key 'task.path': {task}:4: not JSON: " in run.output()


async def test_the_controller_serves_templated_prompts_and_never_an_overlong_one(
        tmp_path: Path, tiny_llama: Path, partition: str) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Reverse {n}."}], "answer": str(n)[::-1]} for n in range(10, 16)]
    rows.insert(2, {"prompt": "Reverse " + "9" * 130 + ".", "answer": "9"})
    task = write_jsonl(tmp_path / "task.jsonl", rows)
    config = tiny_config(tmp_path, partition, model={"name": str(tiny_llama)},
                         task={"name": "jsonl", "path": str(task), "system_prompt": "Digits only.",
                               "overlong_prompts": "drop"},
                         generation={"group_size": 2, "max_new_tokens": 4, "max_inflight_prompts": 4},
                         trainer={"groups_per_step": 4}, async_rl={"buffer_capacity_groups": 8})
    dropped = REGISTRY.get_sample_value("scd_prompts_dropped_total", {"reason": "overlong"})
    tokenizer = HFPolicy(config.model).tokenizer
    expected = {tuple(tokenizer.apply_chat_template([{"role": "system", "content": "Digits only."}, *row["prompt"]],
                                                    add_generation_prompt=True, return_dict=False))
                for row in rows if row["prompt"] != rows[2]["prompt"]}
    served: list[GroupRequest] = []
    async with Controller.open(config) as controller:
        assert REGISTRY.get_sample_value("scd_prompts_dropped_total", {"reason": "overlong"}) == dropped + 1
        generate = controller.backend.generate

        async def recording(requests: list[GroupRequest], on_sibling: Any) -> Any:
            served.extend(requests)
            return await generate(requests, on_sibling)

        controller.backend.generate = recording  # type: ignore[method-assign]
        await controller.run(max_steps=2)
    # Two steps of four groups cycle through all six prompts the task kept: each is its template's ids.
    assert {req.prompt_ids for req in served} == expected
