"""Prompts rendered once, at load, to the token ids the trainer and every backend see.

A built-in task's prompt is raw text, encoded as it always was.  A dataset's
prompt goes through a chat template when one applies (``task.chat_template``:
the tokenizer's own under "auto", a Jinja file, or none), as
``apply_chat_template(messages, add_generation_prompt=True)`` tokenizes it; a
text prompt becomes the user's message and ``task.system_prompt`` a system
message before it.  No backend re-tokenizes text, so trainer and engine agree on
every token.

A prompt longer than ``task.max_prompt_tokens`` refuses the run, naming its
file:line and both lengths, or is dropped and counted (``task.overlong_prompts``).
Characters the tokenizer maps to its unknown token are counted and named once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from scd.config import Config, TaskConfig
from scd.errors import ConfigError
from scd.model.policy import Policy
from scd.tasks import BUILTIN_TASKS, Prompt, build_task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    prompt: Prompt
    token_ids: tuple[int, ...]  # what the model is shown, special tokens included
    max_tokens: int  # the completion budget, generation.max_new_tokens: generation and a restore's prefixes obey it


@dataclass(frozen=True, slots=True)
class RenderedTask:
    prompts: list[RenderedPrompt]  # those the run uses, numbered in order from 0
    dropped_overlong: int


@dataclass(frozen=True, slots=True)
class PromptLimit:
    tokens: int
    why: str  # where the number comes from, for the error that quotes it


def render_task(config: Config, policy: Policy, task: TaskConfig | None = None) -> RenderedTask:
    """The task's prompts (``task``'s: another file read as the task's, the eval's) as token ids, overlong ones
    refused or dropped (blocking: call it off the loop)."""
    task = task or config.task
    limit = prompt_limit(config, policy)
    template = chat_template(task, policy)
    if task.system_prompt and template is None:
        raise ConfigError("task.system_prompt", "is given to the model as a system message through a chat template, "
                                                f"and none applies ({_no_template_reason(task)})")
    kept: list[RenderedPrompt] = []
    overlong: list[str] = []
    unknown = _UnknownCharacters(policy, task.system_prompt)
    for prompt in build_task(task):
        token_ids = _token_ids(prompt, template, task, policy)
        answer_ids = policy.encode_answer(prompt.answer) if isinstance(prompt.answer, str) else []
        unknown.count(prompt, token_ids, answer_ids)
        if len(token_ids) > limit.tokens:
            if task.overlong_prompts == "refuse":
                raise ConfigError("task.max_prompt_tokens",
                                  f"{prompt.where}: the prompt is {len(token_ids)} tokens, longer than the "
                                  f"{limit.tokens} allowed ({limit.why}); shorten it, or set "
                                  'task.overlong_prompts = "drop" to leave such prompts out')
            overlong.append(prompt.where)
            continue
        kept.append(RenderedPrompt(replace(prompt, prompt_id=len(kept)), tuple(token_ids),
                                   config.generation.max_new_tokens))
    unknown.report()
    if overlong:
        log.warning("left out %d prompts longer than %d tokens (%s; task.overlong_prompts = \"drop\"), the first "
                    "at %s", len(overlong), limit.tokens, limit.why, overlong[0])
    if not kept:
        raise ConfigError("task.max_prompt_tokens", f"every prompt is longer than {limit.tokens} tokens ({limit.why})")
    return RenderedTask(kept, len(overlong))


def prompt_limit(config: Config, policy: Policy) -> PromptLimit:
    """The longest prompt a completion of ``generation.max_new_tokens`` still fits the model's context beside."""
    context, context_why = policy.context_tokens, "the model's context"
    if config.generation.backend == "vllm" and config.generation.vllm.max_model_len < context:
        context, context_why = config.generation.vllm.max_model_len, "generation.vllm.max_model_len"
    new_tokens = config.generation.max_new_tokens
    room = context - new_tokens
    if config.task.max_prompt_tokens:
        if config.task.max_prompt_tokens > room:
            raise ConfigError("task.max_prompt_tokens", f"{config.task.max_prompt_tokens} tokens of prompt and "
                                                        f"generation.max_new_tokens = {new_tokens} do not fit "
                                                        f"{context_why} of {context} tokens")
        return PromptLimit(config.task.max_prompt_tokens, "task.max_prompt_tokens")
    if room < 1:
        raise ConfigError("generation.max_new_tokens", f"{new_tokens} leaves no room for a prompt in {context_why} "
                                                       f"of {context} tokens")
    return PromptLimit(room, f"{context_why} of {context} minus generation.max_new_tokens = {new_tokens}")


def chat_template(task: TaskConfig, policy: Policy) -> str | None:
    """The Jinja template dataset prompts are rendered with; None: they are raw text."""
    if task.name in BUILTIN_TASKS or task.chat_template == "none":
        return None
    if task.chat_template == "auto":
        return policy.chat_template
    return Path(task.chat_template).read_text()


def _no_template_reason(task: TaskConfig) -> str:
    if task.chat_template == "none":
        return 'task.chat_template = "none"'
    return 'task.chat_template = "auto" and the tokenizer of model.name has no chat template; set ' \
           "task.chat_template to a Jinja file"


def _token_ids(prompt: Prompt, template: str | None, task: TaskConfig, policy: Policy) -> list[int]:
    if template is None:
        if not isinstance(prompt.prompt, str):
            raise ConfigError("task.chat_template", f"{prompt.where}: the prompt is chat messages, and no chat "
                                                    f"template applies ({_no_template_reason(task)})")
        return policy.encode_prompt(prompt.prompt)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.prompt}] \
        if isinstance(prompt.prompt, str) else prompt.prompt
    if task.system_prompt:
        messages = [{"role": "system", "content": task.system_prompt}, *messages]
    try:
        return policy.encode_chat(messages, template)
    except TemplateError as exc:
        raise ConfigError("task.chat_template", f"{prompt.where}: the chat template failed: {exc}") from None


class _UnknownCharacters:
    """Tokens the tokenizer could only map to its unknown token, and which characters they were."""

    def __init__(self, policy: Policy, system_prompt: str) -> None:
        self._policy = policy
        self._system_prompt = system_prompt
        self._tokens = 0
        self._characters: set[str] = set()
        self._first = ""

    def count(self, prompt: Prompt, token_ids: list[int], answer_ids: list[int]) -> None:
        unk = self._policy.unk_id
        found = token_ids.count(unk) + answer_ids.count(unk) if unk is not None else 0
        if not found:
            return
        self._tokens += found
        self._first = self._first or prompt.where
        texts = [prompt.prompt] if isinstance(prompt.prompt, str) else [m["content"] for m in prompt.prompt]
        for text in (*texts, self._system_prompt, prompt.answer if answer_ids else ""):
            self._characters |= self._policy.unknown_characters(text)

    def report(self) -> None:
        if self._tokens:
            log.warning("%d tokens of the task's prompts and answers are the tokenizer's unknown token, the first at "
                        "%s; the characters: %s", self._tokens, self._first,
                        ", ".join(repr(ch) for ch in sorted(self._characters)))
