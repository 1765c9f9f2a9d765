"""Models whose logits are more than their output head's (a logit scale, soft-capping): the trainer's chunked
logprobs are the Hugging Face model's own, and an architecture it cannot match is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from scd.errors import ConfigError
from scd.model.init_tiny import write_tokenizer
from scd.training.grpo import completion_logprobs
from tests.test_mixed_precision import rows_for, trainer_for

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=0.3))


def cohere() -> nn.Module:
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(**COMMON, logit_scale=0.5))


def granite() -> nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(**COMMON, logits_scaling=4.0))


def falcon_h1() -> nn.Module:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return FalconH1ForCausalLM(FalconH1Config(**COMMON, head_dim=16, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16,
                                              mamba_d_state=8, mamba_chunk_size=8, lm_head_multiplier=3.0))


def saved(build: Callable[[], nn.Module], directory: Path) -> Path:
    torch.manual_seed(0)
    build().save_pretrained(directory)
    write_tokenizer(directory)
    return directory


@pytest.mark.parametrize("build", [gemma2, cohere, granite],
                         ids=["gemma2_final_logit_softcapping", "cohere_logit_scale", "granite_logits_scaling"])
def test_chunked_logprobs_are_the_hf_models_own_for_scaled_and_soft_capped_logits(
        build: Callable[[], nn.Module], tmp_path: Path) -> None:
    trainer = trainer_for(saved(build, tmp_path / "model"), tmp_path, lr=1e-3, logprob_chunk_tokens=5)
    tokens = torch.randint(4, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 11)
    mask[:, 4:] = 1.0
    with torch.no_grad():
        chosen, _ = trainer.completion_token_logprobs(tokens, mask)
        logits = trainer.policy.logits(trainer.model, tokens)  # the HF model's forward
        reference = completion_logprobs(trainer.sampling.logprobs(logits), tokens) * mask
        plain_head = trainer.model.get_output_embeddings()(trainer.policy.hidden(trainer.model, tokens))
    assert (plain_head - logits).abs().max() > 0.05  # the transform matters at this model's scale
    torch.testing.assert_close(chosen, reference, rtol=0, atol=1e-5)
    before = trainer.step(rows_for(trainer, 0), weight_version=0)
    assert torch.isfinite(torch.tensor(before.loss)) and before.tokens > 0


def test_a_model_whose_logits_are_not_its_heads_is_refused_naming_it(tmp_path: Path) -> None:
    """Falcon-H1 multiplies its head's logits by ``lm_head_multiplier``, which scd does not apply: refused at
    start, not trained on wrong logprobs."""
    directory = saved(falcon_h1, tmp_path / "model")
    with pytest.raises(ConfigError, match=r"FalconH1ForCausalLM.*differ from its output head's") as caught:
        trainer_for(directory, tmp_path)
    assert caught.value.exit_code == 2
