"""Checkpoints off the critical path (issue 12): the cut is a metadata-only hold, TQ saves while commits go on.

Real TQ on the session's Ray, a real controller's commit path and checkpointer, a real restore into a
fresh controller.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import anyio
import torch

from scd.checkpoint import layout
from scd.config import DataPlaneConfig
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.generation.base import GroupRequest, GroupResult
from scd.ledger import PromptState
from scd.model.policy import SPECIAL_TOKENS, TinyPolicy
from scd.records import Completion, FinishReason
from scd.schema import Outcome, Sidecar, Trigger, decode
from scd.triggers import Triggers
from tests.conftest import tiny_config
from tests.support.scores import ZERO_SCORES

ROW_TOKENS = 600


def long_group(request: GroupRequest, seed: int) -> GroupResult:
    """A complete group of ``ROW_TOKENS``-token siblings, as a backend would return it."""
    generator = torch.Generator().manual_seed(seed)
    completions = [
        Completion(torch.randint(len(SPECIAL_TOKENS), TinyPolicy.vocab_size, (ROW_TOKENS,), generator=generator)
                   .tolist(), (-torch.rand(ROW_TOKENS, generator=generator)).tolist(), FinishReason.LENGTH, 0)
        for _ in request.siblings
    ]
    return GroupResult(request, completions, end_weight_version=0)


async def test_commits_go_on_during_the_tq_save_and_the_bundle_restores_to_exactly_the_cut(
    partition: str, tmp_path: Path
) -> None:
    config = tiny_config(tmp_path, partition, task={"size": 10_000},
                         async_rl={"buffer_capacity_groups": 10_000},
                         checkpointing={"enabled": True, "interval_s": 3600, "keep_last": 2})
    committed: list[tuple[float, str]] = []
    async with Controller.open(config) as controller:
        # ~1,000 groups of 8 rows of ~7 KB: a TQ save long enough to commit through.
        for seed in range(1_000):
            await controller.rollouts.commit(long_group(await controller.rollouts.admit(), seed), ZERO_SCORES)
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        stop = anyio.Event()

        async def commit_stream() -> None:
            seed = 10_000
            while not stop.is_set():
                request = await controller.rollouts.admit()
                await controller.rollouts.commit(long_group(request, seed), ZERO_SCORES)
                committed.append((time.monotonic(), request.group_id))
                seed += 1

        async with anyio.create_task_group() as tg:
            await tg.start(checkpointer.run_writer)
            tg.start_soon(commit_stream)
            await anyio.sleep(0.3)
            started = time.monotonic()
            outcome = await checkpointer.attempt(Trigger.SIGNAL, wait=True)
            ended = time.monotonic()
            stop.set()
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        barrier = controller.state.barrier.statistics()
        bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
        sidecar = decode(bundle / layout.SIDECAR_FILE, Sidecar)
        cut_keys = {g.group_id for g in sidecar.groups}
        sample = sorted(cut_keys)[:50]
        expected = dict(zip(sample, await controller.dataplane.get_groups(sample), strict=True))

    assert outcome is Outcome.COMPLETED
    during = [gid for t, gid in committed if started < t < ended and gid not in cut_keys]
    assert during, "no commit landed after the cut while the checkpoint was taken"
    # Puts went on inside the TQ save window (not only once it closed), and the bundle names every key they used.
    assert sidecar.uncut_keys
    assert not cut_keys & set(sidecar.uncut_keys)
    # No mutation waited on the barrier for more than the cut itself.
    assert max(barrier.max_wait_seconds.values(), default=0.0) < 0.5, barrier

    await DataPlane(DataPlaneConfig(partition=partition)).clear_all()
    async with Controller.open(config) as fresh:
        await fresh.restore()
        assert fresh.state.replay.keys() == cut_keys
        assert await fresh.dataplane.list_keys() == cut_keys
        for key, rows in zip(expected, await fresh.dataplane.get_groups(list(expected)), strict=True):
            assert len(rows) == len(expected[key])
            for (ids, logprobs), (want_ids, want_logprobs) in zip(rows, expected[key], strict=True):
                assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)
        # A group of the stream is ready after restore exactly when the cut holds it; one committed
        # after the cut is in flight (admitted before it) or unknown (admitted after), and generated again.
        for _, group_id in committed:
            state = fresh.state.ledger.state_of(group_id)
            if group_id in cut_keys:
                assert state is PromptState.READY, (group_id, state)
            else:
                assert state in (None, PromptState.IN_FLIGHT), (group_id, state)
    await DataPlane(DataPlaneConfig(partition=partition)).clear_all()


async def test_synthetic_engine_keeps_generating_through_a_running_daemons_checkpoints(
    partition: str, tmp_path: Path
) -> None:
    """The load-testing backend: complete groups of the configured lengths at its rate, trained on;
    a checkpoint of the running daemon never leaves it without work."""
    config = tiny_config(
        tmp_path, partition, model={"max_len": 64},
        generation={"backend": "synthetic", "max_new_tokens": 40,
                    "synthetic": {"tokens_per_s": 4000.0, "min_completion_tokens": 20, "max_completion_tokens": 40}},
        async_rl={"buffer_capacity_groups": 256, "sampler": {"name": "windowed", "max_staleness_versions": 1000}},
        checkpointing={"enabled": True, "interval_s": 3600, "keep_last": 2})
    samples: list[tuple[bool, int]] = []
    async with Controller.open(config) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()

        async def probe() -> None:
            while True:
                samples.append((checkpointer.statistics().writing, controller.tokens.statistics().generated_tokens))
                await anyio.sleep(0.005)

        async def request_checkpoints() -> None:
            while True:
                await anyio.sleep(1.0)
                triggers.request_checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            tg.start_soon(request_checkpoints)
            await controller.run(triggers, max_steps=25)
            tg.cancel_scope.cancel()
        groups = controller.state.replay.groups()
        completed = checkpointer.statistics().completed

    await DataPlane(DataPlaneConfig(partition=partition)).clear_all()
    assert completed >= 2
    for group in groups:
        assert all(20 <= n - group.prompt_len <= 40 for n in group.seq_lens), group.seq_lens
    # Tokens kept coming while bundles were being written.
    during = [b[1] - a[1] for a, b in itertools.pairwise(samples) if a[0] and b[0]]
    assert sum(during) > 0, "the engine produced nothing while checkpoints were written"
