"""The generated-token count, kept by the generation pump from what every backend hands back.

A sibling counts as it is reported (``SiblingSink``), the rest of a request's siblings when its
result returns, aborted partial output included (it was generated).  A sibling resumed from a
prefix counts only the tokens past it: an earlier run generated the prefix.  The count feeds
``scd_generation_tokens_total``, the train steps' token rate and the loss window.

Each completion counts once too, by why it ended (``scd_completions_total{finish_reason}``), and a
complete one's length (a resumed one's prefix included) goes to ``scd_completion_tokens``; the train
steps report the share truncated at ``generation.max_new_tokens`` and the mean length of the complete
completions generated since the step before.
"""

from __future__ import annotations

from dataclasses import dataclass

from scd.generation.base import GroupRequest, GroupResult, SiblingSink
from scd.records import COMPLETE, Completion, FinishReason
from scd.telemetry import metrics


@dataclass(frozen=True, slots=True)
class TokenCounterStatistics:
    # All cumulative, over this process's life.
    generated_tokens: int
    complete_completions: int
    truncated_completions: int  # complete ones that ended at generation.max_new_tokens
    complete_completion_tokens: int  # their whole lengths, prefixes included


class TokenCounter:
    def __init__(self) -> None:
        self._generated = 0
        self._complete = 0
        self._truncated = 0
        self._complete_tokens = 0
        for reason in FinishReason:  # every series exists from the start, at zero
            metrics.completions.labels(reason.value)
        self._reported: set[tuple[str, int]] = set()  # (group id, sibling index) counted before its result

    def counting(self, on_sibling: SiblingSink) -> SiblingSink:
        """``on_sibling``, counting each sibling it is given."""

        def counted(request: GroupRequest, index: int, completion: Completion) -> None:
            self._reported.add((request.group_id, index))
            self._count(request, index, completion)
            on_sibling(request, index, completion)

        return counted

    def result(self, result: GroupResult) -> None:
        """A request's result: its siblings not reported yet count now."""
        request = result.request
        # An incomplete result may hold fewer completions than siblings asked for.
        for index, completion in zip(request.siblings, result.completions, strict=False):
            if (request.group_id, index) not in self._reported:
                self._count(request, index, completion)
        self._reported.difference_update((request.group_id, index) for index in request.siblings)

    def statistics(self) -> TokenCounterStatistics:
        return TokenCounterStatistics(self._generated, self._complete, self._truncated, self._complete_tokens)

    def _count(self, request: GroupRequest, index: int, completion: Completion) -> None:
        prefix = request.prefix_of(index)
        tokens = len(completion.token_ids) - (len(prefix.token_ids) if prefix else 0)
        self._generated += tokens
        metrics.generation_tokens.inc(tokens)
        metrics.completions.labels(completion.finish_reason.value).inc()
        if completion.finish_reason in COMPLETE:
            self._complete += 1
            self._truncated += completion.finish_reason is FinishReason.LENGTH
            self._complete_tokens += len(completion.token_ids)
            metrics.completion_tokens.observe(len(completion.token_ids))
