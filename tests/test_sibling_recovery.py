"""Sibling-level recovery: a group caught part-finished keeps its finished siblings across a crash.

The synthetic engine decodes a batch in lockstep, so a group's siblings finish one by one
(shortest first) and each is reported as it finishes; real TQ, real Ray, real training.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
import torch

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.generation.base import GenerationBackend, GroupResult
from scd.ledger import PromptState
from scd.records import Completion, FinishReason
from tests.conftest import ScdProcess, tiny_config, write_config
from tests.test_crash_loop import effective_history
from tests.test_data_safety import checkpoint_now
from tests.test_process import metric, scrape

SYNTHETIC = {"backend": "synthetic", "max_inflight_prompts": 8, "max_new_tokens": 40,
             "synthetic": {"tokens_per_s": 300.0, "min_completion_tokens": 2, "max_completion_tokens": 40,
                           "batch_groups": 4, "max_concurrent_batches": 1}}


async def wait_for(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not condition():
            await anyio.sleep(0.01)


def in_flight_staged(controller: Controller) -> dict[str, tuple[tuple[int, int], ...]]:
    ledger = controller.state.ledger
    return {gid: ledger.entry(gid).staged for gid in ledger.in_state(PromptState.IN_FLIGHT)
            if ledger.entry(gid).staged}


async def crash_mid_generation_and_resume(config: Any, backend: GenerationBackend | None = None) -> int:
    """Generate 4 groups until some siblings are staged, checkpoint while generation goes on, then
    cut generation off as a crash would.  A fresh controller restores the bundle: its staged
    siblings come back whole, only the missing ones are generated, and each group commits with the
    staged rows in it.  Returns how many siblings were reused.

    Staging alone: without prefixes, so that what comes back is what was staged (a finished sibling
    still queued at the cut, and part-way ones, come back through prefixes: tests/test_prefix_resume.py)."""
    config = msgspec.structs.replace(
        config, checkpointing=msgspec.structs.replace(config.checkpointing, capture_prefixes=False))
    async with Controller.open(config, backend) as controller:
        requests = [await controller.rollouts.admit() for _ in range(4)]
        async with anyio.create_task_group() as tg:
            await tg.start(controller.rollouts.scorer)
            await tg.start(controller.rollouts.committer)
            generating = anyio.CancelScope()

            async def generate() -> None:
                with generating:
                    await controller.backend.generate(requests, controller.rollouts.on_sibling)
                generating.cancel()  # done: nothing more will be staged

            tg.start_soon(generate)
            # Eight staged siblings, or all there will be (a group's last sibling is never staged).
            with anyio.fail_after(120):
                while sum(map(len, in_flight_staged(controller).values())) < 8 and not generating.cancel_called:
                    await anyio.sleep(0.01)
            assert await checkpoint_now(controller) == "completed"
            generating.cancel()  # the crash: nothing generated after this point survives
            tg.cancel_scope.cancel()
        finished = {r.group_id: controller.rollouts.finished_siblings(r.group_id) for r in requests}
        await controller.dataplane.clear_all()  # the crash took TQ's contents with it

    bundle = verify_bundle(layout.finalized_bundles(Path(config.checkpointing.dir))[-1])
    staged = {gid: e.staged for gid, e in bundle.ledger.entries().items() if e.staged}
    assert staged and all(len(s) < 8 for s in staged.values()), staged
    staged_rows = {gid: {i: finished[gid][i] for i, _ in s} for gid, s in staged.items()}
    reused = sum(map(len, staged.values()))

    async with Controller.open(config, backend) as controller:
        await controller.restore()
        events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
        restore = [e for e in events if e["event"] == "restore"][-1]
        assert restore["siblings_reused"] == reused and restore["siblings_rerun"] == 0
        for gid, siblings in staged_rows.items():
            # Read back whole: tokens and logprobs as generated, under the version that made them.
            for index, completion in siblings.items():
                back = controller.rollouts.finished_siblings(gid)[index]
                assert back.token_ids == completion.token_ids and back.weight_version == completion.weight_version
                # Logprobs are stored as float32, as the rows trained on are.
                assert back.logprobs == torch.tensor(completion.logprobs, dtype=torch.float32).tolist()
            assert controller.rollouts.request(gid).siblings == tuple(i for i in range(8) if i not in siblings)

        # Generation finishes only the missing siblings; the committed group holds the staged ones.
        redone = [controller.rollouts.request(gid) for gid in staged]
        async with anyio.create_task_group() as tg:
            await tg.start(controller.rollouts.scorer)
            await tg.start(controller.rollouts.committer)
            for result in await controller.backend.generate(redone, lambda *reported: None):
                assert len(result.completions) == len(result.request.siblings)
                assert controller.rollouts.gather(result)
            while controller.rollouts.statistics().awaiting_commit:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert sum(len(r.siblings) for r in redone) == 8 * len(redone) - reused
        # The staged keys' clears are owed at commit (carried by the next clear), then gone.
        await controller.dataplane.clear_owed()
        assert await controller.dataplane.list_keys() == set(staged)
        prompt_len = {r.group_id: len(r.prompt_ids) for r in redone}
        for gid, rows in zip(staged, await controller.dataplane.get_groups(list(staged)), strict=True):
            assert controller.state.ledger.state_of(gid) is PromptState.READY
            for index, completion in staged_rows[gid].items():
                assert rows[index][0][prompt_len[gid]:].tolist() == completion.token_ids
        await controller.dataplane.clear_all()
    return reused


async def test_finished_siblings_survive_a_crash_and_only_the_missing_ones_are_generated(
    partition: str, tmp_path: Path
) -> None:
    config = tiny_config(tmp_path, partition, generation=SYNTHETIC,
                         checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600})
    assert await crash_mid_generation_and_resume(config) > 0


def test_sigkill_with_groups_part_finished_reuses_their_siblings_and_trains_each_prompt_once(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    sampler = "windowed"  # the gated samplers' crash recovery: tests/test_crash_loop.py
    extra = (
        "\n[checkpointing]\nenabled = true\ninterval_s = 3600\nkeep_last = 3\n"
        f'[async_rl.sampler]\nname = "{sampler}"\nmax_staleness_versions = 1\n'
    )
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=extra)
    text = config.read_text().replace(
        "[generation]\n", '[generation]\nbackend = "synthetic"\n', 1).replace(
        "max_new_tokens = 4\n", "max_new_tokens = 40\n", 1).replace(
        "[generation.torch]\nbatch_groups = 8\n",
        "[generation.synthetic]\ntokens_per_s = 600.0\nmin_completion_tokens = 2\nmax_completion_tokens = 40\n"
        "batch_groups = 4\nmax_concurrent_batches = 2\n")
    config.write_text(text)
    port = int(next(line for line in text.splitlines() if line.startswith("metrics_port")).split("=")[1])
    root = tmp_path / "out" / "checkpoints"
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("TransferQueue: controller on")
    # Checkpoints only when asked: the newest bundle at the kill is the one inspected here.
    staged: dict[str, list[list[int]]] = {}
    deadline = time.monotonic() + 150
    while not staged:
        assert time.monotonic() < deadline, first.output()[-3000:]
        before = len(layout.finalized_bundles(root))
        first.signal(signal.SIGUSR1)
        asked = time.monotonic()
        # A checkpoint with no step since the last is skipped: ask again after a while.
        while len(layout.finalized_bundles(root)) == before and time.monotonic() - asked < 10:
            assert first.proc.poll() is None, first.output()[-3000:]
            time.sleep(0.05)
        if len(layout.finalized_bundles(root)) == before:
            continue
        bundle = layout.finalized_bundles(root)[-1]
        sidecar = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())
        staged = {e[0]: e[6] for e in sidecar["ledger"]["entries"] if e[3] == "in_flight" and e[6]}
    first.kill_group()
    assert first.wait(timeout=30) == -signal.SIGKILL

    info = verify_bundle(bundle).info
    oldest = info.weight_version - 1
    in_window = sum(v >= oldest for siblings in staged.values() for _, v in siblings)
    second = ScdProcess(config, "--max-steps", str(info.step + 8))
    scd_processes.append(second)
    second.wait_for_line("restored ")
    text_metrics = scrape(port)
    assert metric(text_metrics, "scd_recovery_siblings_reused_total") == in_window
    assert metric(text_metrics, "scd_recovery_siblings_rerun_total") == sum(map(len, staged.values())) - in_window
    assert second.wait(timeout=300) == 0, second.output()[-3000:]

    events = [orjson.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_bytes().splitlines()]
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["step"] == info.step and restore["siblings_reused"] == in_window > 0
    history = effective_history(events)
    assert [e["step"] for e in history] == list(range(1, info.step + 9))
    trained = [tuple(p) for e in history for p in e["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    final = verify_bundle(layout.finalized_bundles(root)[-1])
    trained_again = 0
    for gid in staged:
        # Each part-finished group trained once, or was dropped as stale, or is still on its way (a
        # finished epoch's terminal entries are folded into counts: uniqueness above covers those).
        state = final.ledger.state_of(gid)
        epoch, prompt = (int(x[1:]) for x in gid.split("-"))
        trained_again += trained.count((epoch, prompt))
        if state is not None:
            assert trained.count((epoch, prompt)) == (state is PromptState.CONSUMED)
    assert trained_again > 0
    print(f"sibling recovery ({sampler}): {in_window} of {sum(map(len, staged.values()))} staged siblings "
          f"in window, all reused; {len(staged)} part-finished groups")



async def test_staged_siblings_outside_the_window_are_generated_again(partition: str, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, partition, generation=SYNTHETIC,
                         async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 1}},
                         checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600})
    async with Controller.open(config) as controller:
        live_request, restored_request = await controller.rollouts.admit(), await controller.rollouts.admit()
        async with anyio.create_task_group() as tg:
            await tg.start(controller.rollouts.scorer)
            await tg.start(controller.rollouts.committer)
            for request, indices in ((live_request, (0, 1, 2)), (restored_request, (3, 5))):
                for index in indices:
                    controller.rollouts.on_sibling(request, index, Completion([7, 8, index], [-0.5, -0.25, -1.0],
                                                                              FinishReason.STOP, 0))
            await wait_for(lambda: len(controller.state.ledger.staged_keys()) == 5)
            # Two steps on: weight version 2, window 1, so siblings of version 0 are stale.
            await controller.state.finish_step([])
            await controller.state.finish_step([])
            # Live: an aborted attempt goes back to generation whole, its stale staged siblings dropped.
            aborted = GroupResult(live_request, [], end_weight_version=2, aborted="aborted by vLLM")
            again = await controller.rollouts.redispatch_aborted(aborted)
            assert again.siblings == tuple(range(8))
            await wait_for(lambda: controller.state.ledger.entry(live_request.group_id).staged == ())
            assert await controller.dataplane.list_keys() == {f"{restored_request.group_id}/3/v0",
                                                              f"{restored_request.group_id}/5/v0"}
            assert await checkpoint_now(controller) == "completed"
            tg.cancel_scope.cancel()
    await DataPlane(config.data_plane).clear_all()

    # Restored: the other group's staged siblings are out of the window too, and generated again.
    async with Controller.open(config) as controller:
        await controller.restore()
        assert controller.state.weight_version == 2
        events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
        restore = [e for e in events if e["event"] == "restore"][-1]
        assert (restore["siblings_reused"], restore["siblings_rerun"]) == (0, 2)
        assert controller.state.ledger.entry(restored_request.group_id).staged == ()
        assert await controller.dataplane.list_keys() == set()
        assert controller.rollouts.request(restored_request.group_id).siblings == tuple(range(8))


async def test_staged_siblings_are_counted_while_staged_and_not_once_their_groups_commit(
    partition: str, tmp_path: Path
) -> None:
    """``StateStatistics.staged_siblings`` (the scd_staged_siblings gauge) is the ledger's staged count."""
    config = tiny_config(tmp_path, partition, generation=SYNTHETIC)
    async with Controller.open(config) as controller:
        state = controller.state
        rollouts = controller.rollouts
        requests = [await rollouts.admit() for _ in range(4)]
        seen: list[tuple[int, int]] = []  # (statistics, the ledger's staged keys) while generating

        async def observe() -> None:
            while True:
                seen.append((state.statistics().staged_siblings, len(state.ledger.staged_keys())))
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            await tg.start(rollouts.scorer)
            await tg.start(rollouts.committer)
            tg.start_soon(observe)
            for result in await controller.backend.generate(requests, rollouts.on_sibling):
                assert rollouts.gather(result)
            await wait_for(lambda: rollouts.statistics().awaiting_commit == 0)
            tg.cancel_scope.cancel()
        assert all(counted == staged for counted, staged in seen)
        assert max(counted for counted, _ in seen) > 0
        stats = state.statistics()
        assert stats.staged_siblings == 0 and stats.ledger["ready"] == 4
        await controller.dataplane.clear_all()
