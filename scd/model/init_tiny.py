"""``scd model init-tiny DIR``: a random-init Llama and a character tokenizer, made locally.

No machine scd is tested on reaches a model hub, so tests, the example vLLM
config and the GPU check all serve a model made here.  The tokenizer has one
token per character of the tiny policy's alphabet, so the built-in tasks
tokenize the same way under both policies.  vLLM's CPU attention rejects a
head_dim of 16: the defaults give 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scd.model.policy import ALPHABET, BOS, EOS, PAD, SPECIAL_TOKENS, UNK


@dataclass(frozen=True, slots=True)
class TinyLlamaShape:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    max_position_embeddings: int = 128
    initializer_range: float = 0.02
    seed: int = 0


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(ALPHABET)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[UNK]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS[BOS]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS)])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=SPECIAL_TOKENS[EOS],
        unk_token=SPECIAL_TOKENS[UNK], pad_token=SPECIAL_TOKENS[PAD],
    ).save_pretrained(directory)


def init_tiny(directory: Path, shape: TinyLlamaShape = TinyLlamaShape()) -> Path:
    """Write the model and tokenizer into ``directory`` (created); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(SPECIAL_TOKENS) + len(ALPHABET), hidden_size=shape.hidden_size,
        intermediate_size=4 * shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings, initializer_range=shape.initializer_range,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(shape.seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory
