"""scd on a two-node Ray cluster on loopback: the head on 127.0.0.2, a worker on 127.0.0.3 carrying the
custom resource TQ's storage units ask for.  The cluster is this module's (started and stopped here, its
processes only); real `scd run` subprocesses join it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from tests.conftest import TINY, ScdProcess, free_port

STORAGE_RESOURCE = "tq_storage"
WORKER_IP = "127.0.0.3"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # Ray's test cluster advertises itself in <RAY_TMPDIR>/ray/ray_current_cluster, where a plain
    # ray.init() anywhere on this machine would find and join it: keep that file private.
    private = tempfile.mkdtemp(prefix="scd-ray-", dir="/tmp")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = private
    try:
        started = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.2", "num_cpus": 2, "include_dashboard": False})
        started.worker = started.add_node(node_ip_address=WORKER_IP, num_cpus=2,
                                          resources={STORAGE_RESOURCE: 4})
        started.wait_for_nodes()
        yield started
        started.shutdown()
    finally:
        if previous is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(private, ignore_errors=True)


def cluster_config(directory: Path, address: str, resource: str = STORAGE_RESOURCE) -> Path:
    text = TINY.format(max_steps=100_000, out=directory / "out", port=free_port()).replace(
        "[data_plane.ray]\nnum_cpus = 3",
        f'[data_plane]\nstorage_units = 2\nrequired_node_resource = "{resource}"\ncall_timeout_s = 20\n'
        f'[data_plane.ray]\naddress = "{address}"')
    path = directory / "scd.toml"
    path.write_text(text + "\n[checkpointing]\nenabled = true\ninterval_s = 1.0\nkeep_last = 2\n")
    return path


def start_events(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "out" / "events.jsonl").read_bytes().splitlines()
    return [e for e in map(orjson.loads, lines) if e["event"] == "start"]


def run_until_a_bundle(cluster: Any, directory: Path, scd_processes: list[ScdProcess]) -> tuple[Path, ScdProcess]:
    """A `scd run` that joined the cluster and has finalized a bundle past step 0 (the interval's first
    checkpoint may come before the first step); its config."""
    config = cluster_config(directory, cluster.address)
    process = ScdProcess(config)
    scd_processes.append(process)
    process.wait_for_line("step 1 version", timeout=180)
    deadline = time.monotonic() + 180
    while not any((layout.step_of(b) or 0) > 0 for b in layout.finalized_bundles(directory / "out" / "checkpoints")):
        assert time.monotonic() < deadline and process.proc.poll() is None, process.output()[-3000:]
        time.sleep(0.2)
    return config, process


def test_scd_joins_the_cluster_checkpoints_and_a_new_scd_restores(
    cluster: Any, tmp_path: Path, scd_processes: list[ScdProcess]
) -> None:
    config, first = run_until_a_bundle(cluster, tmp_path, scd_processes)
    root = tmp_path / "out" / "checkpoints"
    # Its storage units run on the worker node, its TQ controller beside it on the head.
    (start,) = start_events(tmp_path)
    assert start["tq_storage_unit_nodes"] == [WORKER_IP, WORKER_IP]
    assert start["tq_controller_node"] == "127.0.0.2"
    assert "is shared with the storage nodes 127.0.0.3" in first.output()
    first.signal(signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL

    newest = layout.finalized_bundles(root)[-1]
    verify_bundle(newest)
    k = layout.step_of(newest)
    assert k is not None and k > 0
    second = ScdProcess(config, "--max-steps", str(k + 2))
    scd_processes.append(second)
    assert second.wait(timeout=180) == 0, second.output()[-3000:]
    # The restore passed its exact-inventory check against TQ's shards from the worker node.
    assert f"restored {newest}: step {k}," in second.output()
    assert layout.step_of(layout.finalized_bundles(root)[-1]) == k + 2
    assert start_events(tmp_path)[-1]["tq_storage_unit_nodes"] == [WORKER_IP, WORKER_IP]


@contextmanager
def node_seeing_other_storage(cluster: Any, ip: str, resource: str, path: Path, log: Path) -> Iterator[None]:
    """A Ray node, joined to ``cluster``, on which ``path`` is other storage than here.

    Its processes run in a mount namespace of their own with another directory mounted over
    ``path``: the same name, a different disk, as with a node-local path on a real cluster.
    Stopped by its process group, which this test started.
    """
    elsewhere = Path(tempfile.mkdtemp(prefix="scd-node-local-", dir="/tmp"))
    path.mkdir(parents=True, exist_ok=True)
    start = ('mount --bind "$1" "$2" && exec "$3" start --block --address="$4" --node-ip-address="$5" '
             '--num-cpus=2 --resources="$6"')
    with log.open("wb") as out:
        node = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", start, "sh", str(elsewhere), str(path),
             str(Path(sys.executable).parent / "ray"), cluster.address, ip,
             orjson.dumps({resource: 2}).decode()],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n["Alive"] and n["NodeManagerAddress"] == ip for n in cluster.global_state.node_table()):
            assert node.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_a_checkpoint_dir_the_storage_node_does_not_share_is_refused_with_exit_2(
    cluster: Any, tmp_path: Path, scd_processes: list[ScdProcess]
) -> None:
    ip, resource = "127.0.0.4", "tq_storage_node_local"
    config = cluster_config(tmp_path, cluster.address, resource)
    with node_seeing_other_storage(cluster, ip, resource, tmp_path / "out" / "checkpoints", tmp_path / "node.log"):
        process = ScdProcess(config)
        scd_processes.append(process)
        assert process.wait(timeout=180) == 2, process.output()[-3000:]
    out = process.output()
    assert "checkpointing.dir" in out and f"is not the same storage on node {ip}" in out, out[-3000:]
    assert "mount" in out and "from shared storage on every node" in out
    assert not layout.finalized_bundles(tmp_path / "out" / "checkpoints")


def test_a_dead_storage_node_stops_scd_with_exit_1_naming_it(
    cluster: Any, tmp_path: Path, scd_processes: list[ScdProcess]
) -> None:
    """Last in this module: it takes the worker node down."""
    _, victim = run_until_a_bundle(cluster, tmp_path, scd_processes)
    root = tmp_path / "out" / "checkpoints"
    bundles = {b: layout.bundle_files(b, {}) for b in layout.finalized_bundles(root)}
    cluster.remove_node(cluster.worker, allow_graceful=False)  # this module's node: its processes only
    assert victim.wait(timeout=120) == 1, victim.output()[-3000:]
    out = victim.output()
    assert "timed out" in out and WORKER_IP in out, out[-3000:]
    # Finalized bundles untouched (retention may have removed an older one after a newer success).
    after = layout.finalized_bundles(root)
    assert after and set(after) >= set(bundles) - {b for b in bundles if layout.step_of(b) < layout.step_of(after[0])}
    for bundle in after:
        if bundle in bundles:
            assert layout.bundle_files(bundle, {}) == bundles[bundle]
        verify_bundle(bundle)
