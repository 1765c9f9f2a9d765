"""An scd SIGKILLed as an OOM kill would take it (its main process only) leaves no process of its
embedded Ray or of its experiment trackers, and a new scd started at once restores, runs on past the point
where such runs used to die (issue 20), and takes its Ray down when it exits.

Before the fix, Ray's agents and TQ's actors outlived each kill, and an scd started soon after
a killed one lost its GCS ~30 s in ("Failed to connect to GCS").
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from scd.checkpoint import layout
from tests.conftest import ScdProcess, write_config

GONE_WITHIN_S = 30.0
# The last run must outlive the moment runs started after a kill used to die (~30 s in), with room.
FINAL_RUN_S = 45.0
# The synthetic engine works through all its requests at TOKENS_PER_S, so every step, which needs
# groups never trained before, waits for at least STEP_TOKENS / TOKENS_PER_S seconds: a floor
# under the last run's length that no machine speed breaks, at little CPU.
TOKENS_PER_S = 512
STEP_TOKENS = 8 * 8 * 16  # groups_per_step (tests/conftest.py TINY) x group_size x completion tokens
# A restored run trains at most its bundle's ready groups (buffer_capacity_groups = 32, 4 steps)
# and its staged siblings (up to 8 prompts in flight, 1 step) without generating them.
STEPS_WITHOUT_GENERATION = 5
FINAL_STEPS = STEPS_WITHOUT_GENERATION + int(FINAL_RUN_S * TOKENS_PER_S / STEP_TOKENS)

# Every tracker on: their processes must go with scd too (each sees its stdin end, or its parent gone).
CONFIG_EXTRA = (
    'trackers = ["tensorboard", "wandb", "mlflow"]\n[telemetry.wandb]\nmode = "offline"\n'
    "\n[checkpointing]\nenabled = true\ninterval_s = 1.0\nkeep_last = 2\n"
    '[async_rl.sampler]\nname = "windowed"\nmax_staleness_versions = 1\n'
)


def lifetime_config(directory: Path) -> Path:
    """TINY with the synthetic engine at TOKENS_PER_S; one step's groups in flight, so none goes stale."""
    config = write_config(directory, max_steps=100_000, extra=CONFIG_EXTRA)
    text = config.read_text()
    for old, new in [
        ("[generation]\n", '[generation]\nbackend = "synthetic"\n'),
        ("max_new_tokens = 4\n", "max_new_tokens = 16\n"),
        ("max_inflight_prompts = 16\n", "max_inflight_prompts = 8\n"),
        ("[generation.torch]\nbatch_groups = 8\n",
         f"[generation.synthetic]\ntokens_per_s = {TOKENS_PER_S}.0\nmin_completion_tokens = 16\n"
         "max_completion_tokens = 16\nbatch_groups = 4\nmax_concurrent_batches = 2\n"),
    ]:
        assert old in text, old
        text = text.replace(old, new, 1)
    config.write_text(text)
    return config


def process_table() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, session id, start time, name) of every live process (zombies are dead)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces and parentheses itself.
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), int(fields[3]), int(fields[19]), comm)
    return table


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def processes_of(scd: ScdProcess) -> dict[tuple[int, int], str]:
    """Every live process scd started, at any depth, or in its session: (pid, start time) -> name."""
    table = process_table()
    root = scd.proc.pid
    in_session = {pid for pid, (_, session, _, _) in table.items() if session == root and pid != root}
    # Every descendant, also below one in the session: W&B's service starts a session of its own.
    descendants: set[int] = set()
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _, _, _) in table.items() if ppid == parent and pid not in descendants]
        descendants.update(children)
        frontier.extend(children)
    return {(pid, table[pid][2]): table[pid][3] for pid in in_session | descendants}


def survivors(recorded: dict[tuple[int, int], str], within_s: float) -> dict[tuple[int, int], str]:
    """Of ``recorded``, those still alive (same pid and start time) after up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        table = process_table()
        alive = {key: name for key, name in recorded.items()
                 if key[0] in table and table[key[0]][2] == key[1]}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def start_scd(config: Path, scd_processes: list[ScdProcess], *args: str) -> ScdProcess:
    scd = ScdProcess(config, *args)
    scd_processes.append(scd)
    return scd


def test_sigkilled_scd_leaves_no_ray_process_and_the_next_runs_for_minutes(
    tmp_path: Path, scd_processes: list[ScdProcess]
) -> None:
    config = lifetime_config(tmp_path)
    root = tmp_path / "out" / "checkpoints"
    scd = start_scd(config, scd_processes)
    scd.wait_for_line("scd.watch: step ", timeout=180)
    scd.wait_for_line("checkpoint step_", timeout=60)
    # The trackers' processes, and W&B's service once its tracker has opened, are among those that must go.
    deadline = time.monotonic() + 60
    while True:
        started = processes_of(scd)
        names = set(started.values())
        if "wandb-core" in names:
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.5)
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), names
    assert len([pid for pid, _ in started if b"scd.telemetry.tracker_process" in cmdline(pid)]) == 3
    scd.proc.kill()  # the main process only, as an OOM kill takes it
    assert scd.wait(timeout=30) == -signal.SIGKILL
    left = survivors(started, GONE_WITHIN_S)
    assert not left, f"alive {GONE_WITHIN_S:.0f}s after scd's SIGKILL: {sorted(left.items())}"

    newest = layout.finalized_bundles(root)[-1]
    restored_step = layout.step_of(newest) or 0
    started = time.monotonic()
    final = start_scd(config, scd_processes, "--max-steps", str(restored_step + FINAL_STEPS))
    final.wait_for_line(f"restored {newest}: step {restored_step},", timeout=180)
    final.wait_for_line("scd.watch: step ", timeout=60)
    ray_processes = processes_of(final)
    assert final.wait(timeout=FINAL_RUN_S + 300) == 0, final.output()[-3000:]
    ran_s = time.monotonic() - started
    assert ran_s >= FINAL_RUN_S, f"the last run ran {ran_s:.0f}s"
    # A clean exit takes its Ray down too.
    left = survivors(ray_processes, GONE_WITHIN_S)
    assert not left, f"alive {GONE_WITHIN_S:.0f}s after scd exited: {sorted(left.items())}"
