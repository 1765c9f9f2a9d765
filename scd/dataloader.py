"""Seeded prompt order with a durable cursor.

Epoch ``e`` visits every prompt once, in a permutation derived from
``(seed, e)``; the cursor is the position within that permutation.  The whole
state is three integers, so it is cheap to capture inside a checkpoint cut.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class DataloaderState:
    seed: int
    epoch: int = 0
    cursor: int = 0


class PromptOrder:
    def __init__(self, num_prompts: int, state: DataloaderState) -> None:
        self.num_prompts = num_prompts
        self.state = state
        self._order = self._permutation(state.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        random.Random(self.state.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self) -> tuple[int, int]:
        """Advance past the next prompt and return ``(epoch, prompt_id)``."""
        if self.state.cursor == self.num_prompts:
            self.state.epoch += 1
            self.state.cursor = 0
            self._order = self._permutation(self.state.epoch)
        prompt_id = self._order[self.state.cursor]
        self.state.cursor += 1
        return self.state.epoch, prompt_id

    def ranks(self, epoch: int) -> dict[int, int]:
        """Each prompt's position in epoch ``epoch``'s visiting order."""
        return {prompt_id: i for i, prompt_id in enumerate(self._permutation(epoch))}

    def restore(self, seed: int, epoch: int, cursor: int) -> None:
        self.state = DataloaderState(seed=seed, epoch=epoch, cursor=cursor)
        self._order = self._permutation(epoch)
