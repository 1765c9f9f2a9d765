"""The generated-token count, kept by the generation pump from what every backend hands back.

A sibling counts as it is reported (``SiblingSink``), the rest of a request's siblings when its
result returns, aborted partial output included (it was generated).  A sibling resumed from a
prefix counts only the tokens past it: an earlier run generated the prefix.  The count feeds
``scd_generation_tokens_total``, the train steps' token rate and the loss window.
"""

from __future__ import annotations

from dataclasses import dataclass

from scd.generation.base import GroupRequest, GroupResult, SiblingSink
from scd.records import Completion
from scd.telemetry import metrics


@dataclass(frozen=True, slots=True)
class TokenCounterStatistics:
    generated_tokens: int  # cumulative, over this process's life


class TokenCounter:
    def __init__(self) -> None:
        self._generated = 0
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
        return TokenCounterStatistics(self._generated)

    def _count(self, request: GroupRequest, index: int, completion: Completion) -> None:
        prefix = request.prefix_of(index)
        tokens = len(completion.token_ids) - (len(prefix.token_ids) if prefix else 0)
        self._generated += tokens
        metrics.generation_tokens.inc(tokens)
