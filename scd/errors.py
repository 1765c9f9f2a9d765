"""Error types and the process exit code each maps to."""

from __future__ import annotations

EXIT_OK = 0
EXIT_OTHER = 1
EXIT_CONFIG = 2
EXIT_INVARIANT = 3


class ScdError(Exception):
    """Base of scd's own errors; ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_OTHER
    reported = False  # printed already: the CLI says it once, before a teardown that may end the process


class ConfigError(ScdError):
    """A bad config file or command line, naming the offending key."""

    exit_code = EXIT_CONFIG

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


class InvariantViolation(ScdError):
    """A broken controller invariant; the daemon stops rather than continue wrong."""

    exit_code = EXIT_INVARIANT


class DataPlaneError(ScdError):
    """TransferQueue failed, timed out, or returned other rows than asked for."""

    exit_code = EXIT_OTHER


class ShortRead(DataPlaneError):
    """TransferQueue answered a read with fewer rows than asked for (it drops unknown keys silently)."""


class RewardError(ScdError):
    """A reward function failed on a completion (raised, timed out, returned no finite number) and
    ``task.reward_errors = "stop"``: the run stops rather than train on a reward it could not compute."""

    exit_code = EXIT_OTHER

    def __init__(self, reward: str, function: str, prompt_id: int, where: str, cause: str, detail: str) -> None:
        # The prompt by its place in the dataset (file:line), as a load error names it: an id means nothing to a user.
        super().__init__(f"reward {reward!r} (function {function!r}) failed on {where}: {detail}")
        self.reward = reward
        self.function = function
        self.prompt_id = prompt_id
        self.where = where
        self.cause = cause
