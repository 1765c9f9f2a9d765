"""`make bench`'s cluster figures: TQ's storage units on a worker node vs on the head, one run.

A two-node Ray cluster on loopback (head 127.0.0.2, worker 127.0.0.3), started and stopped here, with a
resource on each node that TQ's storage units can be asked for.  Run as its own process (a driver joins
one Ray cluster): ``python -m bench.cluster OUT.json``.  The placements alternate (worker, head, worker,
head): each figure is the median of its two.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import orjson

from bench.commits import checkpoint_now, fill
from bench.configs import tiny
from scd.checkpoint import layout
from scd.daemon import Controller

GROUPS = 2_000
PLACEMENTS = {"worker": "tq_on_worker", "head": "tq_on_head"}


async def one_placement(address: str, where: str, tmp: Path, round_: int) -> dict[str, float]:
    partition = f"cluster-{where}-{round_}"
    config = tiny(tmp / f"{where}{round_}", partition, data_plane={
        "storage_units": 2, "required_node_resource": PLACEMENTS[where], "call_timeout_s": 600.0,
        "ray": {"address": address}}, async_rl={"buffer_capacity_groups": GROUPS + 64},
        task={"size": GROUPS + 64}, checkpointing={"enabled": True, "keep_last": 2})
    async with Controller.open(config) as controller:
        nodes = controller.dataplane.placement.storage_units
        started = time.monotonic()
        await fill(controller, GROUPS, tokens=109)
        commit_s = time.monotonic() - started
        started = time.monotonic()
        await checkpoint_now(controller)
        checkpoint_s = time.monotonic() - started
    bundle = layout.finalized_bundles(Path(config.checkpointing.dir))[-1]
    async with Controller.open(config) as controller:
        report = await controller.restore(bundle)
        assert report is not None
        await controller.dataplane.clear_all()
    return {"commit_groups_per_s": GROUPS / commit_s, "checkpoint_s": checkpoint_s,
            "restore_s": report.phases["total"], "on_worker": float(all(n == "127.0.0.3" for n in nodes))}


async def measure(address: str, tmp: Path) -> dict[str, float]:
    runs: dict[str, list[dict[str, float]]] = {where: [] for where in PLACEMENTS}
    for round_ in range(2):
        for where in PLACEMENTS:
            runs[where].append(await one_placement(address, where, tmp, round_))
    out: dict[str, float] = {"cluster_groups": GROUPS}
    for where, results in runs.items():
        assert all(r["on_worker"] == (where == "worker") for r in results), (where, results)
        for key in ("commit_groups_per_s", "checkpoint_s", "restore_s"):
            out[f"cluster_{key}_units_on_{where}"] = statistics.median(r[key] for r in results)
    for key in ("commit_groups_per_s", "checkpoint_s", "restore_s"):
        worker, head = out[f"cluster_{key}_units_on_worker"], out[f"cluster_{key}_units_on_head"]
        out[f"cluster_{key}_worker_vs_head"] = worker / head
    return out


def main() -> None:
    from ray.cluster_utils import Cluster

    # The test cluster advertises itself in <RAY_TMPDIR>/ray/ray_current_cluster: keep it private.
    private = tempfile.mkdtemp(prefix="scd-ray-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = private
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.2", "num_cpus": 3, "include_dashboard": False,
        "resources": {PLACEMENTS["head"]: 4}})
    cluster.add_node(node_ip_address="127.0.0.3", num_cpus=2, resources={PLACEMENTS["worker"]: 4})
    cluster.wait_for_nodes()
    try:
        with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
            out = anyio.run(measure, cluster.address, Path(tmp), backend="asyncio",
                            backend_options={"use_uvloop": True})
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    Path(sys.argv[1]).write_bytes(orjson.dumps(out))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
