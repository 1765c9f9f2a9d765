"""What a crash keeps, per sampler, and what staging siblings costs the commit path.

``crash_recovery``: a daemon on the synthetic engine (siblings finish one by one) is
cut off right after a checkpoint, as a SIGKILL would; a fresh controller restores.
Reported per sampler: ready groups kept (restored / in the cut), staged siblings
reused (/ staged in the cut: goal 100%), reused / finished in unfinished groups when the
cut was read (a crash at that instant; siblings still queued for staging are the gap),
and how many had finished by the crash (those finished after the cut are lost with it,
like groups committed after it).

``staging_cost``: groups committed through the real commit path into TQ, plain
(A) and with 7 of 8 siblings staged first (B), interleaved A B A B.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import orjson

from bench.commits import ZERO_SCORES, fake_group
from bench.configs import tiny
from scd.checkpoint import layout
from scd.daemon import Controller
from scd.dataplane import DataPlane
from scd.ledger import PromptState
from scd.triggers import Triggers

SAMPLERS = ("windowed", "weight_fifo", "in_order")


def in_flight_finished(controller: Controller) -> int:
    """Finished siblings of groups still in flight, in memory at this instant."""
    return sum(len(controller.rollouts.finished_siblings(gid))
               for gid in controller.state.ledger.in_state(PromptState.IN_FLIGHT))


async def crash_once(config: Any) -> dict[str, float]:
    await DataPlane(config.data_plane).clear_all()
    async with Controller.open(config) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()
        finished_at_cut: list[int] = []
        take_cut = controller.state.snapshot

        def counting_snapshot() -> Any:
            # Under the exclusive hold: what had finished when the cut was read (staged or queued to be).
            finished_at_cut.append(in_flight_finished(controller))
            return take_cut()

        controller.state.snapshot = counting_snapshot  # type: ignore[method-assign]
        finished_at_crash = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run, triggers, 1_000_000)
            await anyio.sleep(8.0)
            # A checkpoint holding ready groups and part-finished ones, then the crash the moment
            # it is written.
            with anyio.fail_after(300):
                while True:
                    before = checkpointer.statistics()
                    triggers.request_checkpoint()
                    # Written, or skipped (no step since the last one): then ask again.
                    while (after := checkpointer.statistics()).skipped == before.skipped \
                            and after.completed == before.completed:
                        await anyio.sleep(0.001)
                    if after.completed == before.completed:
                        continue
                    cut = orjson.loads((layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
                                        / layout.SIDECAR_FILE).read_bytes())
                    if cut["groups"] and any(e[6] for e in cut["ledger"]["entries"]):
                        break
            finished_at_crash = in_flight_finished(controller)
            tg.cancel_scope.cancel()
    await DataPlane(config.data_plane).clear_all()  # the crash took TQ's contents with it
    async with Controller.open(config) as controller:
        await controller.restore()
        await controller.dataplane.clear_all()
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_bytes().splitlines()]
    restore = [e for e in events if e["event"] == "restore"][-1]
    sidecar = orjson.loads((Path(restore["bundle"]) / layout.SIDECAR_FILE).read_bytes())
    staged = sum(len(e[6]) for e in sidecar["ledger"]["entries"] if e[3] == "in_flight")
    return {"ready_in_cut": len(sidecar["groups"]), "ready_restored": restore["groups_restored"],
            "staged_in_cut": staged, "siblings_reused": restore["siblings_reused"],
            "siblings_rerun": restore["siblings_rerun"], "finished_at_crash": finished_at_crash,
            "finished_at_cut": finished_at_cut[-1]}


async def crash_recovery(tmp: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for sampler in SAMPLERS:
        config = tiny(
            tmp / f"crash-{sampler}", partition=f"bench-crash-{sampler}",
            # 16 groups (128 sequences) decode in lockstep, as in a vLLM batch; siblings end at their own length.
            generation={"backend": "synthetic", "max_inflight_prompts": 32, "max_new_tokens": 48,
                        "synthetic": {"tokens_per_s": 4_000.0, "min_completion_tokens": 4,
                                      "max_completion_tokens": 48, "batch_groups": 16,
                                      "max_concurrent_batches": 1}},
            async_rl={"sampler": {"name": sampler, "max_staleness_versions": 1}, "buffer_capacity_groups": 64},
            checkpointing={"enabled": True, "interval_s": 3600.0, "keep_last": 2,
                           "dir": str(tmp / f"crash-{sampler}" / "checkpoints")})
        got = await crash_once(config)
        out[f"crash_{sampler}_ready_groups_kept_ratio"] = got["ready_restored"] / got["ready_in_cut"]
        out[f"crash_{sampler}_ready_groups_in_cut"] = got["ready_in_cut"]
        out[f"crash_{sampler}_siblings_staged_in_cut"] = got["staged_in_cut"]
        out[f"crash_{sampler}_siblings_reused_ratio"] = got["siblings_reused"] / got["staged_in_cut"]
        out[f"crash_{sampler}_siblings_rerun"] = got["siblings_rerun"]
        # A crash at the instant of the cut: what it would keep of every sibling finished by then.
        out[f"crash_{sampler}_siblings_reused_vs_finished_at_cut"] = got["siblings_reused"] / got["finished_at_cut"]
        out[f"crash_{sampler}_siblings_finished_at_cut"] = got["finished_at_cut"]
        # Finished (in groups still unfinished) between the cut and the crash: lost with it.
        out[f"crash_{sampler}_siblings_finished_at_crash"] = got["finished_at_crash"]
    return out


async def crash_with_prefixes_once(config: Any) -> dict[str, float]:
    """A checkpoint while long completions are part-way, the crash the moment it is written, a restore.

    Tokens generated at the cut: the ready groups', every finished sibling's of in-flight groups
    (staged or queued) and every part-way sibling's, read under the exclusive hold.  Tokens given
    back: what the restored controller holds before it generates anything (ready groups after the
    restore's stale eviction, finished siblings, prefixes to resume).
    """
    await DataPlane(config.data_plane).clear_all()
    async with Controller.open(config) as controller:
        checkpointer = controller.checkpointer
        assert checkpointer is not None
        triggers = Triggers()
        at_cut: list[int] = []
        take_cut = controller.state.snapshot

        def counting_snapshot() -> Any:
            ready = sum(g.completion_tokens for g in controller.state.replay.groups())
            finished = controller.rollouts.statistics().finished_tokens
            running = sum(len(p.prefix.token_ids) for p in controller.backend.partial_siblings())
            at_cut.append(ready + finished + running)
            return take_cut()

        controller.state.snapshot = counting_snapshot  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(controller.run, triggers, 1_000_000)
            with anyio.fail_after(300):
                await anyio.sleep(1.0)  # generation under way: a batch of 128 sequences part-way
                done = checkpointer.statistics().completed
                triggers.request_checkpoint()
                while checkpointer.statistics().completed == done:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
    await DataPlane(config.data_plane).clear_all()
    async with Controller.open(config) as controller:
        report = await controller.restore()
        assert report is not None
        stats = controller.rollouts.statistics()
        given_back = (sum(g.completion_tokens for g in controller.state.replay.groups()) + stats.finished_tokens
                      + stats.prefix_tokens)
        await controller.dataplane.clear_all()
    return {"generated_at_cut": at_cut[-1], "given_back": given_back, "resumed": report.siblings_resumed,
            "dropped": report.prefix_tokens_dropped}


async def prefix_recovery(tmp: Path) -> dict[str, float]:
    """``crash_<sampler>_tokens_reused_vs_generated_at_cut`` with prefixes captured, and beside it
    (``..._no_prefixes``) with ``checkpointing.capture_prefixes = false``, today's baseline before them."""
    out: dict[str, float] = {}
    for sampler in SAMPLERS:
        for capture in (True, False):
            name = f"prefix-{sampler}-{capture}"
            config = tiny(
                tmp / name, partition=f"bench-{name}",
                # 16 groups (128 sequences) decode in lockstep with completions of 128-512 tokens, at a
                # pace where a batch takes seconds: most sequences are part-way at any cut.  (Not the
                # 256-2048 of reasoning rollouts: the tiny trainer's attention over 128 rows of 3k
                # tokens does not fit this box's memory.)
                generation={"backend": "synthetic", "max_inflight_prompts": 32, "max_new_tokens": 512,
                            "synthetic": {"tokens_per_s": 20_000.0, "min_completion_tokens": 128,
                                          "max_completion_tokens": 512, "batch_groups": 16,
                                          "max_concurrent_batches": 1}},
                task={"min_digits": 256, "max_digits": 256, "size": 256}, model={"max_len": 1030},
                async_rl={"sampler": {"name": sampler, "max_staleness_versions": 1}, "buffer_capacity_groups": 64},
                checkpointing={"enabled": True, "interval_s": 3600.0, "keep_last": 2, "capture_prefixes": capture,
                               "dir": str(tmp / name / "checkpoints")})
            got = await crash_with_prefixes_once(config)
            key = f"crash_{sampler}_tokens_reused_vs_generated_at_cut" + ("" if capture else "_no_prefixes")
            out[key] = got["given_back"] / got["generated_at_cut"]
            if capture:
                out[f"crash_{sampler}_tokens_generated_at_cut"] = got["generated_at_cut"]
                out[f"crash_{sampler}_siblings_resumed"] = got["resumed"]
    return out


async def staging_cost(tmp: Path, groups: int = 400, rounds: int = 4, tokens: int = 109) -> dict[str, float]:
    """Commit throughput without (A) and with (B) 7 of 8 siblings staged first; interleaved."""
    config = tiny(tmp / "staging", partition="bench-staging", task={"size": 1_000_000},
                  async_rl={"buffer_capacity_groups": groups + 64})
    rates: dict[str, list[float]] = {"plain": [], "staged": []}
    async with Controller.open(config) as controller:
        await controller.dataplane.clear_all()
        for _ in range(rounds):
            for mode in ("plain", "staged"):
                started = time.monotonic()
                for _ in range(groups):
                    result = fake_group(await controller.rollouts.admit(), tokens)
                    if mode == "staged":
                        await controller.state.stage_siblings(
                            [(result.request.group_id, i, c) for i, c in enumerate(result.completions[:-1])])
                    await controller.rollouts.commit(result, ZERO_SCORES)
                rates[mode].append(groups / (time.monotonic() - started))
                await controller.state.finish_step(controller.state.replay.groups())
        await controller.dataplane.clear_all()
    ratios = [s / p for p, s in zip(rates["plain"], rates["staged"], strict=True)]
    return {"staging_plain_commit_groups_per_s": statistics.median(rates["plain"]),
            "staging_staged_commit_groups_per_s": statistics.median(rates["staged"]),
            "staging_commit_rate_ratio": statistics.median(ratios),
            "staging_commit_rate_ratio_spread": max(ratios) - min(ratios)}
