"""``scd model init-tiny DIR``: a random-init Llama and a character tokenizer, made locally.

No machine scd is tested on reaches a model hub, so tests, the example vLLM
config and the GPU check all serve a model made here.  The tokenizer has one
token per character of the tiny policy's alphabet, so the built-in tasks
tokenize the same way under both policies; after those come the characters of
small chat tasks (upper case, more punctuation, newline) and one special token
per chat role, which its chat template puts before each message.  vLLM's CPU
attention rejects a head_dim of 16: the defaults give 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scd.model.policy import ALPHABET, BOS, EOS, PAD, SPECIAL_TOKENS, UNK

# Appended after the tiny policy's alphabet, so every token it has keeps its id.
CHAT_CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ/?!'\"<>|_\n"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Each message is its role's token, a newline, the content and a newline; an assistant turn ends with EOS.
# Newlines are Jinja strings: transformers renders with trim_blocks, which drops a newline after a tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
VOCABULARY = (*SPECIAL_TOKENS, *ALPHABET, *CHAT_CHARACTERS, *ROLE_TOKENS)


@dataclass(frozen=True, slots=True)
class TinyLlamaShape:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    max_position_embeddings: int = 128
    initializer_range: float = 0.02
    seed: int = 0


def write_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(VOCABULARY)},
                                           unk_token=SPECIAL_TOKENS[UNK]))
    # Role tokens are matched whole before the text is split into characters.
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in ROLE_TOKENS])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS[BOS]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=SPECIAL_TOKENS[EOS],
        unk_token=SPECIAL_TOKENS[UNK], pad_token=SPECIAL_TOKENS[PAD],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def init_tiny(directory: Path, shape: TinyLlamaShape = TinyLlamaShape()) -> Path:
    """Write the model and tokenizer into ``directory`` (created); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(VOCABULARY), hidden_size=shape.hidden_size,
        intermediate_size=4 * shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings, initializer_range=shape.initializer_range,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(shape.seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory
