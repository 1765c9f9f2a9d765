"""Half-finished sequences survive a crash: a cut keeps every part-way sibling's tokens, logprobs and
versions, and a restore resumes each from there (the synthetic engine, the session's real TQ)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
import pytest

from scd.checkpoint import layout
from scd.checkpoint.restore import RestoreReport
from scd.checkpoint.verify import BundleError
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.generation.base import GenerationBackend, GroupRequest
from scd.records import Completion
from scd.schema import FinishedSiblingRecord, PrefixRecord, Sidecar, decode
from scd.triggers import Triggers
from tests.conftest import tiny_config
from tests.support.bundles import edit_json, part_way_siblings

# Long completions at a rate where a batch takes seconds: most sequences are part-way at any cut.
SYNTHETIC = {"backend": "synthetic", "max_inflight_prompts": 16, "max_new_tokens": 100,
             "synthetic": {"tokens_per_s": 2_000.0, "min_completion_tokens": 50, "max_completion_tokens": 99,
                           "batch_groups": 4, "max_concurrent_batches": 2}}


def long_task_config(tmp_path: Path, partition: str, checkpoints: Path | None = None, **sections: Any) -> Any:
    # Prompts whose answers are long enough for max_new_tokens: the completion budget is the answer's length.
    return tiny_config(tmp_path, partition, generation=SYNTHETIC,
                       task={"name": "reverse", "min_digits": 100, "max_digits": 100, "size": 64},
                       model={"max_len": 320},
                       checkpointing={"enabled": True, "dir": str(checkpoints or tmp_path / "checkpoints"),
                                      "interval_s": 3600},
                       **sections)


async def crash_after_a_checkpoint_with_prefixes(config: Any, backend: GenerationBackend | None = None) -> Path:
    """Run, checkpoint while siblings are part-way, and stop dead (no final bundle; TQ's contents lost)."""
    root = Path(config.checkpointing.dir)
    async with Controller.open(config, backend) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run, triggers, 1_000_000)
            with anyio.fail_after(120):
                while controller.state.trainer_step < 1:
                    await anyio.sleep(0.05)
                while True:
                    before = checkpointer.statistics()
                    triggers.request_checkpoint()
                    while ((now := checkpointer.statistics()).completed == before.completed
                           and now.skipped == before.skipped):
                        await anyio.sleep(0.01)
                    if now.completed == before.completed:
                        # Skipped: no step since the last bundle (a loaded box trains slower than this asks).
                        # Until 2026-12-07 this waited here for a completion that could not come.
                        step = controller.state.trainer_step
                        while controller.state.trainer_step == step:
                            await anyio.sleep(0.01)
                        continue
                    if part_way_siblings(layout.finalized_bundles(root)[-1]):
                        break
            tg.cancel_scope.cancel()
    await DataPlane(config.data_plane).clear_all()
    return layout.finalized_bundles(root)[-1]


async def test_a_crash_gives_back_part_way_siblings_and_each_resumes_from_its_prefix(
        tmp_path: Path, partition: str) -> None:
    config = long_task_config(tmp_path, partition)
    bundle = await crash_after_a_checkpoint_with_prefixes(config)
    sidecar = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())
    in_bundle = {(p[0], p[1]): p for p in [*sidecar["prefixes"], *sidecar["finished_siblings"]]}
    part_way = {(p[0], p[1]): p for p in sidecar["prefixes"]}
    assert part_way

    async with Controller.open(config) as controller:
        report = await controller.restore()
        assert report is not None
        assert report.siblings_resumed == len(part_way)
        assert report.prefix_tokens_reused == sum(len(p[2]) for p in in_bundle.values())
        assert report.prefix_tokens_dropped == 0
        requeued = await controller.rollouts.take_requeued()
        resumed = {(r.group_id, i): prefix for r in requeued for i, prefix in r.prefixes}
        assert set(resumed) == set(part_way)
        for key, prefix in resumed.items():  # bit-identical to what the bundle holds
            assert list(prefix.token_ids) == part_way[key][2] and list(prefix.logprobs) == part_way[key][3]
            assert [list(run) for run in prefix.version_runs] == [list(run) for run in part_way[key][4]]

        # Generated on: each resumed sibling's completion starts with its prefix, is as old as it,
        # and its group trains once.
        completed: dict[tuple[str, int], Completion] = {}
        sink = controller.rollouts.on_sibling

        def watch(request: GroupRequest, index: int, completion: Completion) -> None:
            completed[(request.group_id, index)] = completion
            sink(request, index, completion)

        controller.rollouts.on_sibling = watch  # type: ignore[method-assign]
        with anyio.fail_after(180):
            triggers = Triggers()
            async with anyio.create_task_group() as tg:
                async def stop_when_resumed() -> None:
                    while not set(resumed) <= set(completed):
                        await anyio.sleep(0.05)
                    triggers.shutdown.set()
                tg.start_soon(stop_when_resumed)
                await controller.run(triggers, max_steps=100_000)
        for key, prefix in resumed.items():
            completion = completed[key]
            n = len(prefix.token_ids)
            assert completion.token_ids[:n] == list(prefix.token_ids)
            assert completion.logprobs[:n] == list(prefix.logprobs)
            assert len(completion.token_ids) > n and completion.weight_version == prefix.oldest_version
        await controller.dataplane.clear_all()
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
    trained = [tuple(p) for e in events if e["event"] == "train_step" for p in e["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt trained twice"
    restore = [e for e in events if e["event"] == "restore"][-1]
    assert (restore["siblings_resumed"], restore["prefix_tokens_reused"], restore["prefix_tokens_dropped"]) == (
        report.siblings_resumed, report.prefix_tokens_reused, 0)


async def test_a_prefix_out_of_the_window_is_dropped_and_generated_again_and_a_wrong_one_is_refused(
        tmp_path: Path, partition: str) -> None:
    config = long_task_config(tmp_path, partition)
    bundle = await crash_after_a_checkpoint_with_prefixes(config)
    step = layout.step_of(bundle)
    assert step is not None

    # A window of 0 versions at the cut's step: every prefix sampled before it is out.
    narrow = long_task_config(tmp_path, partition, async_rl={"sampler": {"max_staleness_versions": 0}})
    prefixes = part_way_siblings(bundle)
    old = [p for p in prefixes if p[4][0][1] < step]
    assert old, "no prefix older than the cut's version"
    async with Controller.open(narrow) as controller:
        report = await controller.restore(allow_config_change=True)
        assert report is not None
        assert report.prefix_tokens_dropped >= sum(len(p[2]) for p in old)
        requeued = await controller.rollouts.take_requeued()
        resumed = {(r.group_id, i) for r in requeued for i, _ in r.prefixes}
        assert not resumed & {(p[0], p[1]) for p in old}
        again = {(r.group_id, i) for r in requeued for i in r.siblings}
        assert {(p[0], p[1]) for p in old} <= again  # generated again, from the prompt
        await controller.dataplane.clear_all()

    # A prefix with a version above the cut's, or lengths that disagree: exit 3 naming the group.
    victim = next(p for p in prefixes if len(p[2]) > 1)
    for name, change in (("a version above the cut's", lambda p: p[4].append([1, step + 1])),
                         ("lengths that disagree", lambda p: p[3].pop())):

        def corrupt(sidecar: dict[str, Any], change: Any = change) -> None:
            change(next(p for p in sidecar["prefixes"] if p[:2] == victim[:2]))

        root = tmp_path / f"bad-{len(name)}"
        shutil.copytree(bundle, root / bundle.name)
        edit_json(root / bundle.name, layout.SIDECAR_FILE, corrupt)
        bad = long_task_config(tmp_path, partition, checkpoints=root)
        await DataPlane(config.data_plane).clear_all()
        async with Controller.open(bad) as controller:
            with pytest.raises(BundleError) as refused:
                await controller.restore()
        assert refused.value.exit_code == 3, name
        assert f"group {victim[0]}" in str(refused.value), name


def as_schema_4(document: dict[str, Any]) -> None:
    """A schema 5 sidecar rewritten as schema 4 wrote it: a finished sibling the cut did not stage was a
    prefix with a finish reason, of one version run."""
    document["schema_version"] = 4
    finished = document.pop("finished_siblings")
    document["prefixes"] = [[*p, ""] for p in document["prefixes"]] + [
        [group_id, index, token_ids, logprobs, [[0, version]], finish] for
        group_id, index, token_ids, logprobs, version, finish in finished]


def test_a_schema_4_sidecar_reads_its_finished_prefixes_as_finished_siblings(tmp_path: Path) -> None:
    sidecar = {"schema_version": 4, "partition": "p", "replay_digest": "d", "groups": [],
               "ledger": {"entries": [], "pruned": {}},
               "sampler": {"name": "windowed", "state": {}, "supports_replay_checkpoint": True},
               "prefixes": [["g1", 0, [5, 6], [-0.5, -0.25], [[0, 2], [1, 3]], ""],
                            ["g1", 1, [7], [-1.0], [[0, 3]], "stop"], ["g2", 3, [8, 9], [-0.1, -0.2], [[0, 1]]]]}
    (tmp_path / "sidecar.json").write_bytes(msgspec.json.encode(sidecar))
    read = decode(tmp_path / "sidecar.json", Sidecar)
    assert read.prefixes == [PrefixRecord("g1", 0, [5, 6], [-0.5, -0.25], [(0, 2), (1, 3)]),
                             PrefixRecord("g2", 3, [8, 9], [-0.1, -0.2], [(0, 1)])]
    assert read.finished_siblings == [FinishedSiblingRecord("g1", 1, [7], [-1.0], 3, "stop")]


def comparable(report: RestoreReport, requeued: list[GroupRequest]) -> tuple[Any, ...]:
    return (report.step, report.groups_restored, report.groups_evicted_stale, report.prompts_redispatched,
            report.siblings_reused, report.siblings_rerun, report.stale_tokens, report.prefix_tokens_reused,
            report.prefix_tokens_dropped, report.siblings_resumed,
            sorted((r.group_id, r.siblings, r.prefixes) for r in requeued))


async def test_a_bundle_written_as_schema_4_restores_as_it_does_as_schema_5(tmp_path: Path, partition: str) -> None:
    config = long_task_config(tmp_path, partition)
    bundle = await crash_after_a_checkpoint_with_prefixes(config)
    restored: dict[str, tuple[Any, ...]] = {}
    for schema in ("5", "4"):
        root = tmp_path / f"schema-{schema}"
        shutil.copytree(bundle, root / bundle.name)
        if schema == "4":
            edit_json(root / bundle.name, layout.SIDECAR_FILE, as_schema_4)
            edit_json(root / bundle.name, layout.DATALOADER_FILE, lambda d: d.update(schema_version=4))
            edit_json(root / bundle.name, layout.TRAINING_INFO_FILE, lambda d: d.update(schema_version=4))
            assert part_way_siblings(root / bundle.name)
        await DataPlane(config.data_plane).clear_all()
        async with Controller.open(long_task_config(tmp_path, partition, checkpoints=root)) as controller:
            report = await controller.restore()
            assert report is not None
            restored[schema] = comparable(report, await controller.rollouts.take_requeued())
            await controller.dataplane.clear_all()
    assert restored["4"] == restored["5"]
    assert restored["5"][9] > 0  # part-way siblings resumed


async def test_a_prefix_longer_than_its_answer_within_max_new_tokens_is_resumed(tmp_path: Path,
                                                                                 partition: str) -> None:
    # 4-digit answers, completions of 50-99 tokens: one rule, generation.max_new_tokens, bounds both what
    # generation writes and the prefixes a restore takes up (the answer's length once bounded only the latter).
    config = long_task_config(tmp_path, partition)
    config = msgspec.structs.replace(config, task=msgspec.structs.replace(config.task, min_digits=4, max_digits=4))
    bundle = await crash_after_a_checkpoint_with_prefixes(config)
    part_way = part_way_siblings(bundle)
    assert any(len(p[2]) > 4 for p in part_way)
    async with Controller.open(config) as controller:
        report = await controller.restore()
        assert report is not None
        assert report.siblings_resumed == len(part_way) and report.prefix_tokens_dropped == 0
        await controller.dataplane.clear_all()
