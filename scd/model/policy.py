"""The policy seam: a tokenizer, a model, and a way to export its weights.

The trainer trains a policy and every generation backend serves the same one.
``model.name = "tiny"`` is scd's own small transformer over a character
vocabulary; anything else names a local Hugging Face directory, loaded with
``AutoModelForCausalLM`` and ``AutoTokenizer`` (never from a hub).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from scd.config import ModelConfig
from scd.errors import ConfigError
from scd.model.weights import StorageKey, storage_key

TINY = "tiny"

# The tiny policy's character vocabulary; `scd model init-tiny` gives its HF tokenizer the same characters.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=,.:;()[] "
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
_INDEX = {ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(ALPHABET)}


class Policy(Protocol):
    """What the trainer and the generation backends share."""

    model_dir: Path | None  # a local HF directory, or None for the tiny model
    pad_id: int

    unk_id: int | None  # the tokenizer's unknown token (None: it has none, as byte-level BPE)
    eos_id: int | None  # the token that ends a completion (None: only a stop string or the budget does)
    chat_template: str | None  # the tokenizer's own chat template, if it has one
    context_tokens: int  # positions the model has: a prompt and its completion together

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids the model sees for a raw-text prompt (special tokens included)."""
        ...

    def encode_chat(self, messages: list[dict[str, Any]], template: str) -> list[int]:
        """Token ids the model sees for chat messages rendered by ``template``, an assistant turn opened."""
        ...

    def encode_answer(self, text: str) -> list[int]:
        """Token ids of an answer without special tokens: how many tokens a completion may use."""
        ...

    def unknown_characters(self, text: str) -> set[str]:
        """The characters of ``text`` the tokenizer maps to its unknown token."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Completion text, special tokens dropped: what the task scores."""
        ...

    def build_model(self) -> nn.Module:
        """A fresh model of this policy's architecture and initial weights, in train mode."""
        ...

    def build_empty_model(self) -> nn.Module:
        """``build_model``'s architecture on the meta device, in train mode: no storage, no weights (a sharded
        trainer shards it, then fills its shards: ``scd.training.sharding.fill_shards``)."""
        ...

    def reset_buffers(self, model: nn.Module) -> None:
        """Give a model built empty, then moved to a device, the non-persistent buffers ``build_model``'s has
        (RoPE's ``inv_freq``): no checkpoint holds them."""
        ...

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, time, vocab]`` for right-padded ``tokens``."""
        ...

    def hidden(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[batch, time, width]``: ``output_head`` of them is ``logits``."""
        ...

    def output_head(self, model: nn.Module) -> nn.Module:
        """The projection from the final hidden states to the vocabulary's logits."""
        ...

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's repeated blocks: the units FSDP2 shards and activation checkpointing recomputes."""
        ...


class TinyCausalLM(nn.Module):
    """A small pre-LayerNorm causal transformer with learned positions."""

    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, config.d_model)
        self.position = nn.Embedding(config.max_len, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model, config.n_heads, dim_feedforward=4 * config.d_model, dropout=0.0,
            batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, time, vocab]`` for ``tokens`` ``[batch, time]``."""
        return self.head(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[batch, time, d_model]``, normalised: what the head projects."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token(tokens) + self.position(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.norm(self.blocks(hidden, mask=mask, is_causal=True))


class TinyPolicy:
    model_dir = None
    pad_id = PAD
    unk_id = UNK
    eos_id = EOS
    chat_template = None
    vocab_size = len(SPECIAL_TOKENS) + len(ALPHABET)

    def __init__(self, config: ModelConfig, seed: int) -> None:
        self._config = config
        self._seed = seed
        self.context_tokens = config.max_len

    def encode_prompt(self, text: str) -> list[int]:
        return [BOS, *self.encode_answer(text)]

    def encode_chat(self, messages: list[dict[str, Any]], template: str) -> list[int]:
        raise ConfigError("task.chat_template", "model.name = 'tiny' has no tokenizer to apply a chat template "
                                                'with: set task.chat_template = "none" and give text prompts, or '
                                                "serve a Hugging Face model (`scd model init-tiny DIR` makes one)")

    def encode_answer(self, text: str) -> list[int]:
        return [_INDEX.get(ch, UNK) for ch in text]

    def unknown_characters(self, text: str) -> set[str]:
        return set(text) - set(ALPHABET)

    def decode(self, token_ids: Sequence[int]) -> str:
        skip = len(SPECIAL_TOKENS)
        return "".join(ALPHABET[t - skip] for t in token_ids if t >= skip)

    def build_model(self) -> nn.Module:
        torch.manual_seed(self._seed)
        return TinyCausalLM(self._config, self.vocab_size)

    def build_empty_model(self) -> nn.Module:
        with torch.device("meta"):
            return TinyCausalLM(self._config, self.vocab_size)

    def reset_buffers(self, model: nn.Module) -> None:
        """The tiny model has no buffers."""

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def hidden(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model.hidden(tokens)

    def output_head(self, model: nn.Module) -> nn.Module:
        return model.head

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks.layers


class OutputHead(nn.Module):
    """A Hugging Face model's logits from its final hidden states, as its ``forward`` computes them: the output
    head, then Cohere's ``logit_scale`` (multiplied), Granite's ``logits_scaling`` (divided by) or Gemma-2's
    ``final_logit_softcapping`` (``cap · tanh(logits / cap)``), in the head's dtype."""

    def __init__(self, head: nn.Module, *, scale: float, divisor: float, softcap: float | None) -> None:
        super().__init__()
        self.head = head
        self.scale, self.divisor, self.softcap = scale, divisor, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HFPolicy:
    """A local Hugging Face causal LM directory (``config.json``, safetensors, tokenizer files)."""

    def __init__(self, config: ModelConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model_dir = Path(config.name)
        self._dtype = getattr(torch, config.dtype)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id or 0
        self.unk_id: int | None = self.tokenizer.unk_token_id
        self.eos_id: int | None = self.tokenizer.eos_token_id
        self.chat_template: str | None = self.tokenizer.chat_template
        self.context_tokens: int = AutoConfig.from_pretrained(self.model_dir, local_files_only=True) \
            .max_position_embeddings
        self._heads: weakref.WeakKeyDictionary[nn.Module, OutputHead] = weakref.WeakKeyDictionary()

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], template: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def encode_answer(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def unknown_characters(self, text: str) -> set[str]:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return {text[start:end] for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"],
                                                               strict=True) if token == self.unk_id}

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self._dtype, local_files_only=True)
        return model.train()

    def build_empty_model(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self._dtype)
        return model.train()

    def reset_buffers(self, model: nn.Module) -> None:
        # transformers' own initialisation computes them as ``from_pretrained`` does (it too builds on meta).
        persistent = set(model.state_dict())
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            if any(f"{prefix}{buffer}" not in persistent for buffer, _ in module.named_buffers(recurse=False)):
                model._init_weights(module)

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        # Right padding: a causal model's logits at real positions never see the pad after them.
        return model(input_ids=tokens, use_cache=False).logits.float()

    def hidden(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state

    def output_head(self, model: nn.Module) -> nn.Module:
        # Checked once per model (the torch backend asks at every batch); the head holds no reference to it.
        if model not in self._heads:
            self._heads[model] = self._checked_output_head(model)
        return self._heads[model]

    def _checked_output_head(self, model: nn.Module) -> OutputHead:
        config = model.config
        head = OutputHead(model.get_output_embeddings(),
                          scale=getattr(config, "logit_scale", None) or 1.0,
                          divisor=getattr(config, "logits_scaling", None) or 1.0,
                          softcap=getattr(config, "final_logit_softcapping", None))
        # The trainer's logprobs come from the head of the hidden states, a chunk at a time: a model whose
        # logits are something else would train on wrong numbers without a word.
        probe = torch.arange(min(8, head.weight.shape[0]), device=head.weight.device)[None]
        was_training = model.training
        with torch.no_grad():
            model.eval()
            logits = self.logits(model, probe)
            gap = float((head(self.hidden(model, probe)).float() - logits).abs().max())
            model.train(was_training)
        if gap > 1e-3 * max(1.0, float(logits.abs().max())):
            raise ConfigError("model.name", f"{self.model_dir} ({type(model).__name__}): its logits differ from "
                                            f"its output head's of the final hidden states by up to {gap:.3g}; scd "
                                            "computes logprobs from the hidden states and knows a logit scale "
                                            "(logit_scale, logits_scaling) and soft-capping "
                                            "(final_logit_softcapping) only: this architecture cannot be trained")
        return head

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        # Llama, Qwen, Mistral and most decoder-only HF models keep their blocks at model.model.layers.
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError("trainer.world_size", f"{self.model_dir}: no decoder layers at model.model.layers "
                                                    "to shard; train it at world size 1")
        return layers


def build_policy(config: ModelConfig, seed: int) -> TinyPolicy | HFPolicy:
    if config.name == TINY:
        return TinyPolicy(config, seed)
    path = Path(config.name)
    if not (path / "config.json").is_file():
        raise ConfigError("model.name", f"{config.name!r} is neither 'tiny' nor a local Hugging Face model "
                                        "directory with a config.json (make one with `scd model init-tiny DIR`)")
    return HFPolicy(config)


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached host-memory copy of the weights, safe to hand to another thread.  Tied tensors (an
    embedding shared with the output head) are copied once and stay one tensor under both names: saved
    once, and loaded back into the one parameter they share."""
    copies: dict[StorageKey, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = storage_key(tensor)
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out
