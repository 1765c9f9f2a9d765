"""What the outside world can ask of a running controller: the one object signals (``scd.cli``) and tests set."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio


@dataclass(slots=True)
class Triggers:
    """Shutdown (SIGTERM: drain) and a checkpoint now (SIGUSR1); tests set them directly, with no real signals."""

    shutdown: anyio.Event = field(default_factory=anyio.Event)
    checkpoint_now: anyio.Event = field(default_factory=anyio.Event)

    def request_checkpoint(self) -> None:
        """Several requests before the scheduler takes one coalesce into one checkpoint."""
        self.checkpoint_now.set()
