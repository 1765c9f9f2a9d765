"""Whether the training data got skewed: every prompt's fate counted per bucket, and one skew figure.

Prompts are bucketed once, at start, so that a prompt keeps its bucket from admission to its end:
by the value of ``task.bucket_field`` (a JSONL task's column, such as a difficulty); else by prompt
length in tokens, in quantile buckets; else (every prompt as long as the others) by completion
length, the tokens each prompt's completion may use; else all in one bucket.

The fates are counted per bucket.  The counts live in the controller state and are part of every
checkpoint cut, so a restore continues them where the bundle left them.  The skew figure is the
total variation distance between the distribution of admitted prompts over buckets and that of
trained ones: 0 when every bucket is trained in the share it is admitted in, 1 when the trainer
sees only buckets that were never admitted.  A staleness window that drops slow (long) groups
shows up there first.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Prompt and completion lengths are split at these quantiles (fewer buckets where lengths tie).
LENGTH_QUANTILES = 4


class Fate(enum.StrEnum):
    ADMITTED = "admitted"
    TRAINED = "trained"
    DROPPED_STALE = "dropped_stale"  # a ready group the staleness window dropped while the run went on
    EVICTED = "evicted"  # a restored ready group that was already outside the window when the run came back
    # An in-flight group generation gave back incomplete, sent again; or one a clean exit (a drain) left in
    # flight with siblings to generate, dispatched again by the restore.
    REDISPATCHED = "redispatched"
    # In flight in the restored cut with siblings to generate again: what generation had done for it since
    # died with the process.  One whose every sibling the cut kept (staged, or finished in the cut) lost
    # nothing and is not counted: it only awaits its commit.
    LOST_TO_CRASH = "lost_to_crash"
    # Complete, its rewards all equal (``async_rl.drop_zero_variance_groups``): no GRPO signal, never trained.
    FILTERED = "filtered"


@dataclass(frozen=True, slots=True)
class PromptBuckets:
    """Every prompt's bucket, fixed for the run."""

    basis: str  # what the buckets split: the field's name, "prompt_tokens", "completion_tokens" or "none"
    labels: tuple[str, ...]
    of_prompt: tuple[int, ...]  # index into ``labels``, by prompt id

    @classmethod
    def single(cls, num_prompts: int) -> PromptBuckets:
        return cls("none", ("all",), (0,) * num_prompts)


def _field_order(value: str) -> tuple[int, float, str]:
    """Numbers in numeric order, before other values in text order."""
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def _by_field(name: str, values: Sequence[str]) -> PromptBuckets:
    labels = tuple(sorted(set(values), key=_field_order))
    index = {label: i for i, label in enumerate(labels)}
    return PromptBuckets(name, labels, tuple(index[v] for v in values))


def _by_length(name: str, lengths: Sequence[int]) -> PromptBuckets | None:
    """Quantile buckets of ``lengths``, labelled ``name:lo-hi``; None when every length is the same."""
    ordered = sorted(lengths)
    if ordered[0] == ordered[-1]:
        return None
    cuts = sorted({ordered[(i * len(ordered)) // LENGTH_QUANTILES] for i in range(1, LENGTH_QUANTILES)})
    raw = [bisect.bisect_right(cuts, n) for n in lengths]
    # Ties can leave a quantile bucket empty: only the buckets some prompt falls in are kept.
    present = sorted(set(raw))
    ranges = {b: (min(n for n, r in zip(lengths, raw, strict=True) if r == b),
                  max(n for n, r in zip(lengths, raw, strict=True) if r == b)) for b in present}
    labels = tuple(f"{name}:{lo}" if lo == hi else f"{name}:{lo}-{hi}" for lo, hi in (ranges[b] for b in present))
    position = {b: i for i, b in enumerate(present)}
    return PromptBuckets(name, labels, tuple(position[r] for r in raw))


def bucket_prompts(field: str, field_values: Sequence[str], prompt_tokens: Sequence[int],
                   completion_tokens: Sequence[int]) -> PromptBuckets:
    """The run's buckets: by ``field``'s values when a field is named, else by prompt length, else by
    completion length (``completion_tokens``: what each prompt's completion may use), else one bucket."""
    if field:
        return _by_field(field, field_values)
    return (_by_length("prompt_tokens", prompt_tokens) or _by_length("completion_tokens", completion_tokens)
            or PromptBuckets.single(len(prompt_tokens)))


FateCounts = dict[str, dict[str, int]]  # bucket -> fate -> prompts


class PromptFates:
    """Prompts per bucket and fate.  Counting is one list update; reading copies (a scrape reads from
    another thread, and the buckets never change, so it sees whole numbers)."""

    def __init__(self, buckets: PromptBuckets) -> None:
        self.buckets = buckets
        self._counts = [[0] * len(Fate) for _ in buckets.labels]
        self._fate_index = {fate: i for i, fate in enumerate(Fate)}

    def count(self, prompt_id: int, fate: Fate) -> None:
        self._counts[self.buckets.of_prompt[prompt_id]][self._fate_index[fate]] += 1

    def counts(self) -> FateCounts:
        return {label: {fate.value: row[i] for fate, i in self._fate_index.items()}
                for label, row in zip(self.buckets.labels, self._counts, strict=True)}

    def load(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        """Continue from a bundle's counts.  A bucket or fate this run does not have is left out (the
        operator changed ``task.bucket_field`` or the task); the restore says so."""
        for label, row in zip(self.buckets.labels, self._counts, strict=True):
            saved = counts.get(label, {})
            for fate, i in self._fate_index.items():
                row[i] = saved.get(fate.value, 0)

    def _column(self, fate: Fate) -> list[int]:
        i = self._fate_index[fate]
        return [row[i] for row in self._counts]

    def tvd(self) -> float:
        """Total variation distance between the admitted and the trained distribution over buckets."""
        admitted, trained = self._column(Fate.ADMITTED), self._column(Fate.TRAINED)
        total_admitted, total_trained = sum(admitted), sum(trained)
        if not total_admitted or not total_trained:
            return 0.0
        return 0.5 * sum(abs(a / total_admitted - t / total_trained) for a, t in zip(admitted, trained, strict=True))

    def trained_per_admitted(self) -> dict[str, float]:
        """Per bucket with any admitted prompt: trained ÷ admitted (below the others: a starved bucket)."""
        return {label: t / a for label, a, t in zip(self.buckets.labels, self._column(Fate.ADMITTED),
                                                    self._column(Fate.TRAINED), strict=True) if a}

    def step_fields(self) -> dict[str, object]:
        """What each ``train_step`` event carries of the skew."""
        return {"training_skew_tvd": self.tvd(), "trained_per_admitted": self.trained_per_admitted()}
