"""One worker process of the reward pool (``scd.rewards.pool``): ``python -m scd.rewards.worker OWNER_PID``.

It shares nothing with scd but two pipes, speaking JSON lines:

- stdin: a header ``{"path", "base_dir", "rewards": [{"key", "reward"}, ...]}`` (scd's ``sys.path``, the
  config's directory, and each sync reward's ``[[task.rewards]]`` table with its key); then one call per
  line, ``{"reward": index, "prompt", "completion", "answer", "row"}``.
- stdout, as it was at start (fd 1 is then pointed at stderr, so a reward's prints cannot corrupt it):
  ``{"ready": true}`` once every reward is loaded (and warmed up), or ``{"error"}`` and exit 1; then one line per call,
  ``{"value"}`` (a finite number, or a dict of them with a ``"score"``) or ``{"cause", "detail"}`` (a reward
  that raised ``scd.rewards.RewardUnavailable``: cause ``"unavailable"``, asked again later).

At EOF on stdin it exits.  It dies with the process that started it however that one dies
(``PR_SET_PDEATHSIG``), and scd kills it when a call runs past its deadline.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import orjson

from scd.config import RewardConfig
from scd.errors import ConfigError
from scd.rewards import RewardUnavailable
from scd.rewards.functions import Failure, RewardFunction, checked, load_function

_PR_SET_PDEATHSIG = 1


def die_with(owner: int) -> None:
    """SIGKILL this process when ``owner``, its parent, exits.

    The kernel's signal, not a thread watching the owner's pidfd as ``scd.reaper.open_lineage``'s users do: a
    reward stuck in C code (a regex backtracking) holds the interpreter lock, and a watching thread would
    never run.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != owner:  # the owner exited before the signal was asked for
        os._exit(0)


def _outcome(function: RewardFunction, call: dict[str, Any]) -> dict[str, object]:
    try:
        value = function(call["prompt"], call["completion"], call["answer"], call["row"])
    except RewardUnavailable as exc:  # the reward's own service is down: scd asks again later
        return {"cause": "unavailable", "detail": exc.detail}
    except Exception as exc:
        return {"cause": "exception", "detail": f"raised {type(exc).__name__}: {exc}"}
    outcome = checked(value)
    if isinstance(outcome, Failure):
        return {"cause": outcome.cause, "detail": outcome.detail}
    return {"value": outcome}


def _reply(out: BinaryIO, message: dict[str, object]) -> None:
    out.write(orjson.dumps(message) + b"\n")
    out.flush()


def main(owner: int) -> None:
    die_with(owner)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    calls = sys.stdin.buffer
    header = orjson.loads(calls.readline())
    sys.path[:] = header["path"]
    try:
        loaded = [load_function(msgspec.convert(spec["reward"], RewardConfig), spec["key"], Path(header["base_dir"]))
                  for spec in header["rewards"]]
    except ConfigError as exc:
        _reply(out, {"error": str(exc)})
        sys.exit(1)
    for function in loaded:
        if function.warm_up is not None:
            function.warm_up()
    functions = [function.call for function in loaded]
    _reply(out, {"ready": True})
    for line in calls:
        call = orjson.loads(line)
        _reply(out, _outcome(functions[call["reward"]], call))


if __name__ == "__main__":
    main(int(sys.argv[1]))
