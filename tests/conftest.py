"""One real Ray + TransferQueue per pytest session, and helpers to run a real `scd` subprocess."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TQ_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
SCD = [sys.executable, "-m", "scd.cli"]


# Modules whose tests share one expensive fixture (a vLLM engine, a module's controller or cluster) run on
# one xdist worker, so the fixture starts once; vLLM's modules share one group, since each engine pins
# the same cores and reserves a share of memory.
SHARED_FIXTURE_GROUPS = {
    "test_vllm": "vllm", "test_vllm_engines": "vllm", "test_vllm_sampling": "vllm",
    "test_checkpoint": "test_checkpoint", "test_data_safety": "test_data_safety",
    "test_sampler_restore": "test_sampler_restore", "test_cluster": "test_cluster",
    "test_guarded_behaviours": "test_guarded_behaviours",
}
# A test that needs any of these starts Ray, a vLLM engine or an `scd run`: it is `slow`, outside
# `make test-fast`.  A test that starts a subprocess some other way carries the mark itself.
SLOW_FIXTURES = {"tq_session", "scd_processes", "tiny_llama", "engine", "cluster"}


def shared_fixture_group(item: pytest.Item) -> str | None:
    module = getattr(item, "module", None)
    return SHARED_FIXTURE_GROUPS.get(module.__name__.rsplit(".", 1)[-1]) if module else None


# First, before xdist's own hook turns each `xdist_group` mark into a suffix of the test's id: marks added
# after it group nothing.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # Longest first, so that two workers finish together.  vLLM's group is the longest unit of work: handed
    # out first, it runs beside everything else instead of after it.  xdist hands out the other groups by
    # size (--loadscope-reorder), then single tests in this order: slow ones before quick ones, which fill
    # the tail instead of a worker idling through another's last minute-long run.  A stable sort keeps file
    # order within each class; every worker sorts alike.
    items.sort(key=lambda item: (shared_fixture_group(item) != "vllm", item.get_closest_marker("slow") is None))


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker under ``--dist loadgroup``: every grouped test's id carries its group, or the groups
    are not in effect (until 2026-12-05 they were not: pytest 9.2 ignores the id xdist 3.8 rewrites, and
    the marks came after xdist's hook; vLLM's tests ran on both workers at once)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    ungrouped = [item.nodeid for item in session.items
                 if shared_fixture_group(item) and not item.nodeid.endswith(f"@{shared_fixture_group(item)}")]
    if ungrouped:
        raise pytest.UsageError(f"--dist loadgroup did not group {len(ungrouped)} tests, e.g. {ungrouped[0]}: "
                                "is pytest newer than pytest-xdist supports?")


@pytest.fixture(scope="session")
def tq_session() -> Iterator[None]:
    """A local Ray with enough logical CPUs for TQ's controller, one storage unit and two trainer ranks.

    Each xdist worker is a process of its own, so each has its own Ray and TQ.
    """
    import ray
    import transfer_queue as tq

    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.2",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    yield
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="session")
def session_ray(tq_session: None) -> str:
    """The address of this worker's Ray, for an `scd run` that joins it and attaches to its TQ.

    Starting Ray and TQ is most of what an `scd run` costs on this box (20-30 s under the suite's load,
    against ~1 s to attach), so a test whose subject is not the embedded Ray's own lifecycle joins this
    one (``write_config(..., ray_address=session_ray)``); ``ScdProcess`` then empties the TQ after the
    process ends, as the end of a private TQ would.
    """
    import ray

    SESSION_RAY["address"] = ray.get_runtime_context().gcs_address
    return SESSION_RAY["address"]


# This worker's Ray, once a test asked for it (``session_ray``).
SESSION_RAY: dict[str, str] = {}


def clear_session_tq() -> None:
    """Remove every row of every partition from this worker's TQ."""
    import transfer_queue as tq

    for partition, keys in tq.kv_list().items():
        if keys:
            tq.kv_clear(list(keys), partition)


@pytest.fixture(autouse=True)
def leave_the_session_tq_empty(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the session's TQ leaves it holding no rows, in any partition.

    The tests share one TQ as runs can share one: a restore refuses to load over another
    partition's rows (TQ's load would wipe them), so a row one test left would refuse the next
    test's restore.
    """
    yield
    if "tq_session" in request.fixturenames:
        clear_session_tq()


@pytest.fixture
def partition(tq_session: None) -> str:
    """A fresh TQ partition for one test."""
    return f"test-{uuid.uuid4().hex[:8]}"


# Below the kernel's ephemeral range (32768 and up): a port bound to 0 comes from that range, where Ray's
# processes and every client socket take theirs, and one of them could take it before a test's server binds
# it.  Each xdist worker draws from a slice of its own (Ray's workers keep below 20000), starting at a point
# its pid picks, for another session's suite may run beside this one.
_SLICE = 20_000 + 4_000 * (int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % 3)
_START = _SLICE + os.getpid() % 4_000
_PORTS = itertools.cycle([*range(_START, _SLICE + 4_000), *range(_SLICE, _START)])


def free_port() -> int:
    """A loopback port nobody holds now, from this worker's slice (see ``_PORTS``)."""
    while True:
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


TINY = """
[run]
seed = 0
max_steps = {max_steps}
output_dir = "{out}"

[data_plane.ray]
num_cpus = 3

[generation]
group_size = 8
max_new_tokens = 4
max_inflight_prompts = 16
[generation.torch]
batch_groups = 8

[trainer]
lr = 1e-3
groups_per_step = 8

[task]
name = "reverse"
size = 64

[async_rl]
buffer_capacity_groups = 32

[telemetry]
metrics_port = {port}
"""


def write_config(directory: Path, *, max_steps: int = 20, port: int | None = None, extra: str = "",
                 ray_address: str = "") -> Path:
    """TINY in ``directory``; with ``ray_address`` (``session_ray``) the run joins that Ray instead of its own."""
    text = TINY.format(max_steps=max_steps, out=directory / "out", port=port or free_port())
    if ray_address:
        text = text.replace("[data_plane.ray]\nnum_cpus = 3\n", f'[data_plane.ray]\naddress = "{ray_address}"\n')
    path = directory / "scd.toml"
    path.write_text(text + extra)
    return path


class ScdProcess:
    """A real `scd run` subprocess; stopped by pid only (never by name)."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        # A run that joined the session's Ray leaves its rows in the session's TQ when it ends (a run that
        # joined another cluster, its own).
        address = tomllib.loads(config.read_text()).get("data_plane", {}).get("ray", {}).get("address")
        self.joined_session_tq = bool(address) and address == SESSION_RAY.get("address")
        self.log_path = config.parent / f"scd-{uuid.uuid4().hex[:6]}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*SCD, "run", str(config), *args], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, needle: str, timeout: float = 120, times: int = 1) -> None:
        """Until ``needle`` has appeared in the output ``times`` times."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output().count(needle) >= times:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"scd exited {self.proc.returncode} before {needle!r}:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {needle!r} within {timeout}s:\n{self.output()[-4000:]}")

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._log.close()
        self._ended()
        return code

    def _ended(self) -> None:
        """The process is gone: what it left in the session's TQ goes too (once), as a private TQ would."""
        if self.joined_session_tq:
            self.joined_session_tq = False
            clear_session_tq()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill_group(self) -> None:
        """SIGKILL the process group this test started (scd and the Ray processes it spawned)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self._ended()


@pytest.fixture
def scd_processes() -> Iterator[list[ScdProcess]]:
    started: list[ScdProcess] = []
    yield started
    for p in started:
        # Also reaps Ray processes a killed scd left behind in its process group.
        p.kill_group()


def tiny_config(tmp_path: Path, partition: str, **sections: dict[str, object]) -> Any:
    """configs/tiny.toml with this test's output dir and TQ partition, and section overrides."""
    from scd.config import derive_config

    # Checkpointing (on in configs/tiny.toml, as by default) is left to the tests that turn it on: the others
    # check other things, and a final bundle per test is time they need not spend.
    base = {"run": {"output_dir": str(tmp_path / "out")}, "data_plane": {"partition": partition},
            "telemetry": {"metrics_port": 0}, "checkpointing": {"enabled": False}}
    return derive_config(REPO / "configs" / "tiny.toml", base, sections)


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """A nested dict of scalars as TOML (stdlib reads TOML but does not write it)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    for key, value in scalars.items():
        rendered = ("true" if value else "false") if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else repr(value))
        lines.append(f"{key} = {rendered}")
    text = "\n".join(lines) + "\n"
    for key, table in tables.items():
        text += toml_text(table, f"{prefix}.{key}" if prefix else key)
    return text


def vllm_cpu_config(directory: Path, model_dir: Path, **sections: dict[str, Any]) -> Path:
    """configs/vllm-cpu.toml with this test's model, output dir and port, and section overrides."""
    data = tomllib.loads((REPO / "configs" / "vllm-cpu.toml").read_text())
    data["run"]["output_dir"] = str(directory / "out")
    data["model"]["name"] = str(model_dir)
    data["telemetry"]["metrics_port"] = free_port()
    for section, values in sections.items():
        for key, value in values.items():
            *parents, leaf = key.split(".")
            table = data.setdefault(section, {})
            for parent in parents:
                table = table.setdefault(parent, {})
            table[leaf] = value
    path = directory / "scd.toml"
    path.write_text(toml_text(data))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init HF Llama with a character tokenizer, made locally (no hub)."""
    from scd.model.init_tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny-llama")


def tree_digest(root: Path) -> str:
    """One digest over every file name and content under ``root``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()
