"""The backend table: every name has a class and a config sub-table, and the config accepts no other; free-form
completions on the torch backend (EOS, stop strings, max_new_tokens, top-k / top-p)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch
from prometheus_client import REGISTRY

from scd.config import GENERATION_BACKENDS, Config, GenerationConfig, parse_config
from scd.errors import ConfigError
from scd.generation import BACKENDS
from scd.generation.base import GroupRequest, GroupResult
from scd.generation.tokens import TokenCounter
from scd.generation.torch_backend import TorchBackend
from scd.model.policy import TinyPolicy
from scd.model.sampling import Sampling
from scd.records import Completion, FinishReason, Rollout
from scd.training.grpo import GRPOTrainer, completion_logprobs


def test_every_backend_name_has_a_class_and_its_config_sub_table() -> None:
    assert BACKENDS.keys() == GENERATION_BACKENDS.keys()
    sections = {f.name: f.type for f in msgspec.structs.fields(GenerationConfig)}
    assert all(sections[name] is section for name, section in GENERATION_BACKENDS.items())


def test_a_backend_name_outside_the_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"generation\.backend.*'torch', 'vllm', 'synthetic'"):
        parse_config({"generation": {"backend": "tpu"}}, tmp_path)


@pytest.mark.parametrize(("generation", "key"), [
    ({"top_p": 0.0}, "generation.top_p"), ({"top_p": 1.5}, "generation.top_p"),
    ({"top_k": -1}, "generation.top_k"), ({"stop": ["=", ""]}, "generation.stop"),
    # One budget for every backend: the synthetic engine's lengths too.
    ({"backend": "synthetic", "max_new_tokens": 8,
      "synthetic": {"min_completion_tokens": 1, "max_completion_tokens": 12}},
     "generation.synthetic.max_completion_tokens"),
])
def test_bad_sampling_settings_name_their_key(tmp_path: Path, generation: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"generation": generation}, tmp_path)
    assert info.value.key == key


def test_the_fingerprint_counts_stop_top_p_and_top_k_only_when_set(tmp_path: Path) -> None:
    default = parse_config({}, tmp_path)
    # A config that sets none of them keeps the fingerprint it had before they existed: its bundles restore.
    assert not {"generation.stop", "generation.top_p", "generation.top_k"} & default.fingerprint_fields().keys()
    assert parse_config({"generation": {"top_p": 1.0, "top_k": 0, "stop": []}}, tmp_path).fingerprint() \
        == default.fingerprint()
    changed = {parse_config({"generation": g}, tmp_path).fingerprint()
               for g in ({"top_p": 0.9}, {"top_k": 5}, {"stop": ["\n"]})}
    assert len(changed) == 3 and default.fingerprint() not in changed


def test_top_k_then_top_p_keep_the_likeliest_tokens_at_the_temperature() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    kept = lambda k, p: Sampling(1.0, k, p).logits(logits).isfinite().tolist()  # noqa: E731
    assert kept(0, 1.0) == [True] * 4
    assert kept(2, 1.0) == [False, True, False, True]
    # Ascending 0.05, 0.15, 0.3, 0.5: tokens whose cumulative probability stays within 1 - top_p go.
    assert kept(0, 0.75) == [False, True, False, True]
    assert kept(0, 0.85) == [False, True, True, True]
    assert kept(0, 0.1) == [False, True, False, False]  # the likeliest always stays
    assert kept(3, 0.7) == [False, True, False, True]  # top-p over the top-k's renormalised 0.15, 0.3, 0.5
    truncated = Sampling(2.0, 2, 1.0).logprobs(logits)
    assert torch.allclose(truncated[[1, 3]].exp().sum(), torch.tensor(1.0))
    assert torch.allclose(truncated[1] - truncated[3], (logits[1] - logits[3]) / 2)


def tiny_backend(tmp_path: Path, trainer: dict[str, object] | None = None,
                 **generation: object) -> tuple[TorchBackend, GroupRequest, TinyPolicy, Config]:
    """A torch backend on the tiny policy at its initial weights, and a request for 16 siblings."""
    config = parse_config({"generation": {"temperature": 0.7, **generation}, "trainer": trainer or {}}, tmp_path)
    policy = TinyPolicy(config.model, seed=3)
    request = GroupRequest("e0-p0", 0, 0, tuple(policy.encode_prompt("1234=")), tuple(range(16)),
                           config.generation.max_new_tokens, None, 0.0)
    return TorchBackend(config, policy), request, policy, config


def ignore(request: GroupRequest, index: int, completion: Completion) -> None:
    return None


async def test_torch_completions_end_at_eos_a_stop_string_or_max_new_tokens(tmp_path: Path) -> None:
    backend, request, policy, _ = tiny_backend(tmp_path, max_new_tokens=40, stop=["7", "ab"])
    completions = [c for _ in range(4) for c in (await backend.generate([request], ignore))[0].completions]
    reasons = {c.finish_reason for c in completions}
    assert reasons == {FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH}, reasons
    for c in completions:
        text = policy.decode(c.token_ids)
        assert len(c.token_ids) == len(c.logprobs) <= 40
        # Every token sampled is kept: the one that ended it too, and none after.
        if c.finish_reason is FinishReason.STOP:
            assert text.endswith(("7", "ab")) and not any(s in policy.decode(c.token_ids[:-1]) for s in ("7", "ab"))
            assert not c.truncated
        elif c.finish_reason is FinishReason.EOS:
            assert c.token_ids[-1] == policy.eos_id and policy.eos_id not in c.token_ids[:-1]
            assert not c.truncated
        else:
            assert len(c.token_ids) == 40 and "7" not in text and "ab" not in text
            assert c.truncated  # trainer.loss.mask_truncated gives it no loss
    # Longer than the 4-digit answer: a policy may write before it answers.
    assert max(len(c.token_ids) for c in completions) > 4


async def test_torch_logprobs_under_top_k_and_top_p_are_the_trainers(tmp_path: Path) -> None:
    backend, request, policy, config = tiny_backend(tmp_path, max_new_tokens=12, top_p=0.9, top_k=5)
    [result] = await backend.generate([request], ignore)
    model, sampling = policy.build_model().eval(), Sampling.of(config.generation)  # the weights that sampled
    for c in result.completions:
        tokens = torch.tensor([[*request.prompt_ids, *c.token_ids]])
        with torch.no_grad():
            logits = policy.logits(model, tokens)
        recomputed = completion_logprobs(sampling.logprobs(logits), tokens)[0, len(request.prompt_ids) - 1:]
        untruncated = completion_logprobs(torch.log_softmax(logits / 0.7, -1), tokens)[0, len(request.prompt_ids) - 1:]
        assert torch.allclose(torch.tensor(c.logprobs), recomputed, atol=1e-5)
        assert (recomputed - untruncated).min() > 0.05  # truncation moved every token's logprob


async def test_a_train_step_on_truncated_samples_recomputes_their_logprobs(tmp_path: Path) -> None:
    backend, request, policy, config = tiny_backend(tmp_path, {"entropy_coef": 0.1}, max_new_tokens=12, top_p=0.9,
                                                    top_k=5, stop=["7"])
    groups = []
    for group_id in ("e0-p0", "e0-p1"):
        req = replace(request, group_id=group_id)
        [result] = await backend.generate([req], ignore)
        groups.append([Rollout(torch.tensor([*req.prompt_ids, *c.token_ids]), torch.tensor(c.logprobs),
                               len(req.prompt_ids), reward=float(len(c.token_ids) % 2), weight_version=0)
                       for c in result.completions])
    # The trainer at the weights that sampled (GRPOTrainer builds the policy's initial model, as the backend did).
    step = GRPOTrainer(config, policy).step(groups, weight_version=0)
    assert step.logprob_mismatch_tokens == step.tokens == sum(len(r.logprobs) for g in groups for r in g)
    assert step.logprob_mismatch_max is not None and step.logprob_mismatch_max < 1e-5
    assert math.isfinite(step.loss) and math.isfinite(step.entropy) and step.clip_fraction == 0


def test_the_token_counter_counts_completions_by_how_they_ended() -> None:
    counter = TokenCounter()
    before = {r: REGISTRY.get_sample_value("scd_completions_total", {"finish_reason": r.value}) for r in FinishReason}
    assert None not in before.values()  # every series exists from the start
    request = GroupRequest("e0-p0", 0, 0, (1, 2), tuple(range(4)), 8, None, 0.0)
    ended = [Completion([5] * n, [-1.0] * n, reason, 0) for n, reason in
             ((3, FinishReason.EOS), (8, FinishReason.LENGTH), (5, FinishReason.STOP), (2, FinishReason.ABORT))]
    counter.result(GroupResult(request, ended, end_weight_version=0, aborted="test"))
    stats = counter.statistics()
    # The aborted one is generated, never complete.
    assert (stats.generated_tokens, stats.complete_completions, stats.truncated_completions,
            stats.complete_completion_tokens) == (18, 3, 1, 16)
    assert all(REGISTRY.get_sample_value("scd_completions_total", {"finish_reason": r.value}) == before[r] + 1
               for r in FinishReason)
