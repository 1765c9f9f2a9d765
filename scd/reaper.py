"""The embedded Ray's reaper: a process that outlives scd to kill what scd's Ray left behind.

Ray ties only its GCS and raylet to the thread that started them (PR_SET_PDEATHSIG).  When an
OOM kill or SIGKILL took scd, Ray's dashboard and runtime-env agents and TQ's actors lived on
for a minute or more, holding memory and ports, while the next scd started.

scd starts this process before its embedded Ray, in a session of its own (a signal to scd's
process group or terminal does not reach it), and gives that Ray a temp directory of its own.
Ray points the output of every process it starts at log files there, so a process holding a file
open under that directory is one of this Ray's: that is what the reaper kills by, never a name, a
process group it does not own, or ``ray stop`` (other Ray processes on the machine are not
scd's).  An environment variable would not do: Ray's agents and workers overwrite the start of
their environment block when they set their process title.

When scd exits, however it exits, or when scd asks with SIGUSR1 (after its own
``ray.shutdown``), the reaper SIGKILLs those processes until none is left, removes the
directory, and exits.  It ignores SIGTERM and SIGINT: a stop signal sent to everything of scd's
must not end it while scd still drains.

Standard library only, so that it is watching within milliseconds:
``python -m scd.reaper OWNER_PID RAY_TEMP_DIR``; it writes ``READY`` on stdout once it watches.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

READY = b"READY\n"
# Once the GCS and raylet are gone nothing starts new Ray processes, so a few rounds empty the
# machine of them; the bound only keeps a reaper from spinning on a process that does not die.
SWEEP_LIMIT_S = 10.0


def _holds_file_under(pid: int, prefix: str) -> bool:
    """Whether ``pid`` has a file open whose path starts with ``prefix`` (False if gone or not ours to see)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _other_pids(spared: set[int]) -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in spared:
            yield int(name)


def sweep(directory: str, spared: set[int]) -> list[str]:
    """SIGKILL every process holding a file open under ``directory`` until two rounds in a row find
    none (a raylet killed mid-fork may still hand its child the log files); those killed, as ``name (pid)``."""
    prefix = os.path.join(os.path.realpath(directory), "")
    killed: dict[int, str] = {}
    quiet_rounds = 0
    deadline = time.monotonic() + SWEEP_LIMIT_S
    while quiet_rounds < 2 and time.monotonic() < deadline:
        found = False
        for pid in _other_pids(spared):
            if not _holds_file_under(pid, prefix):
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Look again now that the pidfd pins one process: the pid may have been reused since.
                if _holds_file_under(pid, prefix):
                    killed.setdefault(pid, _name(pid))
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    found = True
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
        quiet_rounds = 0 if found else quiet_rounds + 1
        time.sleep(0.1)
    return [f"{name} ({pid})" for pid, name in killed.items()]


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True, slots=True)
class Lineage:
    """This process's ancestry up to ``owner`` (scd), as the processes that die with scd watch it."""

    # The processes between ``owner`` and this one, this one's parent first (a vLLM engine core, say).
    between: tuple[int, ...]
    # pidfds of ``owner`` and then of each of ``between``, each readable once its process exits; none when
    # ``owner`` is no ancestor of this process any more (it exited: its pid may name another process now).
    pidfds: tuple[int, ...]


def open_lineage(owner: int, max_between: int = 8) -> Lineage:
    """The pidfds to watch so as to die with ``owner``: the one mechanism of the reaper, the engines' workers
    (``scd.generation.weight_transfer``) and the trackers (``scd.telemetry.tracker_process``)."""
    between: list[int] = []
    pid = os.getppid()
    while pid not in (owner, 0, 1) and len(between) < max_between:
        between.append(pid)
        pid = _parent_of(pid)
    if pid != owner:
        return Lineage(tuple(between), ())
    pidfds: list[int] = []
    try:
        for p in (owner, *between):
            pidfds.append(os.pidfd_open(p))
        # Walk again now that the pidfds pin processes: one that exited before its pidfd was opened broke the
        # chain, and its pid may name another process now.
        intact = [os.getppid(), *map(_parent_of, between)] == [*between, owner]
    except OSError:  # one of them has exited already
        intact = False
    if not intact:
        for fd in pidfds:
            os.close(fd)
        return Lineage(tuple(between), ())
    return Lineage(tuple(between), tuple(pidfds))


def wait_readable(fds: Sequence[int]) -> set[int]:
    """Block until one of ``fds`` is readable (a pidfd is once its process exits); those that are."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll()}


def watch(owner: int) -> str:
    """Block until ``owner`` exits or sends SIGUSR1; which of the two happened."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    # A handler, not SIG_IGN: only a handled signal reaches the wakeup fd.
    signal.signal(signal.SIGUSR1, lambda *_: None)
    lineage = open_lineage(owner)
    if not lineage.pidfds:
        return "exited"
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    return "asked" if wait_readable([*lineage.pidfds, wake_read]) == {wake_read} else "exited"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m scd.reaper OWNER_PID RAY_TEMP_DIR", file=sys.stderr)
        return 2
    owner, directory = int(argv[0]), argv[1]
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, signal.SIG_IGN)
    reason = watch(owner)
    killed = sweep(directory, spared={os.getpid(), owner})
    shutil.rmtree(directory, ignore_errors=True)
    if killed:
        why = f"scd (pid {owner}) exited" if reason == "exited" else f"scd (pid {owner}) shut its Ray down"
        print(f"scd reaper: {why}; killed what its embedded Ray left: {', '.join(killed)}", file=sys.stderr,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
