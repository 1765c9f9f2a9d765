"""The trainer as ``trainer.world_size`` ranks on Ray, each a ``GRPOTrainer`` sharded with FSDP2.

The ranks are Ray actors in the placement group ``scd.cluster`` asks for (one bundle of
``trainer.resources_per_rank`` each), on the Ray that scd already runs TQ on.
Rank 0 opens the process group's store on its node's address (loopback on one machine), on a port the
kernel picks while the store binds it: a port probed and let go could be taken before the store listened.

A step sends each rank whole groups (``shard_groups``) and the step's token count: every rank
normalises its loss by the whole step's tokens, so the update equals world size 1's.  Ray runs
one caller's calls to an actor in order, so a capture or a gather submitted between two steps
sees exactly the boundary's state, without the controller waiting for it.

Weights leave the group from rank 0 a decoder layer at a time (``ChunkedWeights``), each rank casting its
shards to ``model.dtype`` before they are gathered (``sharding.gathered``); checkpoints
are written by rank 0 itself.  Neither passes a whole model through scd's process.

A rank that dies fails the call waiting on it at once (``ray.wait`` on every rank), naming the
rank and its node; the others, stuck in a collective, die with the group.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from scd.cluster import place_trainer_ranks
from scd.config import Config
from scd.errors import ScdError
from scd.model.policy import Policy
from scd.model.weights import ChunkedWeights, WeightEntry
from scd.records import Rollout
from scd.telemetry import metrics
from scd.training.base import StepResult, Trainer, TrainerStatistics
from scd.training.grpo import GRPOTrainer, SkippedSteps, combine, publish, split_mini_batches, step_size
from scd.training.loss import StepSize

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

# gloo's and NCCL's own timeout for a collective a peer never joins.
COLLECTIVE_TIMEOUT_S = 600.0


class TrainerRankFailed(ScdError):
    """A trainer rank died or raised; names the rank, its node and process."""


@dataclass(frozen=True, slots=True)
class RankPlace:
    rank: int
    node_ip: str
    pid: int

    def __str__(self) -> str:
        return f"trainer rank {self.rank} (node {self.node_ip}, pid {self.pid})"


def over_object_store(data: np.ndarray, entry: WeightEntry) -> torch.Tensor:
    """The tensor ``entry`` names over its bytes where Ray's object store holds them (kept there while the tensor
    lives).  Read-only, as a weight sync's tensors are read: a backend that keeps one copies it."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(getattr(torch, entry.dtype)).view(entry.shape)


def shard_groups(groups: Sequence[Sequence[Rollout]], world_size: int) -> list[list[Sequence[Rollout]]]:
    """Whole groups to each rank, round robin: a group's advantages need all of its rows."""
    return [list(groups[rank::world_size]) for rank in range(world_size)]


def wait_all(refs: list[Any], places: Sequence[RankPlace], what: str) -> list[Any]:
    """Every result, in order; the first rank to die or raise fails it at once.  Blocking.

    ``refs[i]`` is rank i's call (or rank 0's, for a call to rank 0 alone).
    """
    import ray

    pending = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise TrainerRankFailed(f"{places[i]} died while {what}: {exc.__class__.__name__}. The bundles "
                                        "are untouched; the next start restores from the newest") from None
            except ray.exceptions.RayTaskError as exc:
                raise TrainerRankFailed(f"{places[i]} failed while {what}: {exc.cause!r}") from None
    return results


@functools.cache
def rank_actor() -> Any:
    """The Ray actor class of one trainer rank (made once: Ray registers it on first use)."""
    import ray

    # Rank 0 writes a checkpoint's files on a thread of their own ("writer"), so the next steps
    # need not wait for the disk; every other call keeps Ray's one-at-a-time, in-order default.
    @ray.remote(max_restarts=0, concurrency_groups={"writer": 1})
    class TrainerRank:
        def __init__(self, config: Config, rank: int, world_size: int) -> None:
            self.config, self.rank, self.world_size = config, rank, world_size
            self.trainer: Any = None
            self.store: Any = None  # rank 0's, from ``rendezvous_address``
            self.captured: tuple[dict[str, Any], dict[str, Any]] | None = None

        def place(self) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), os.getpid()

        def rendezvous_address(self) -> tuple[str, int]:
            """Rank 0's store, listening from here on and held by this actor (the process group uses it)."""
            import torch.distributed as dist

            host = ray.util.get_node_ip_address()
            self.store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                       timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), wait_for_workers=False)
            return host, self.store.port

        def setup(self, host: str, port: int) -> list[WeightEntry]:
            import torch
            import torch.distributed as dist

            from scd.model.policy import build_policy
            from scd.training.grpo import GRPOTrainer

            if host.startswith("127."):
                # gloo and NCCL pick an interface by the host name unless told: loopback stays loopback.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            torch.set_num_threads(self.config.trainer.torch_threads)
            cuda = self.config.trainer.device.startswith("cuda")
            timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            store = self.store if self.rank == 0 else dist.TCPStore(host, port, self.world_size, is_master=False,
                                                                   timeout=timeout)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
            # Ray shows each GPU rank only its own device.
            config = self.config
            if cuda:
                import msgspec

                config = msgspec.structs.replace(
                    config, trainer=msgspec.structs.replace(config.trainer, device="cuda:0"))
            self.trainer = GRPOTrainer(config, build_policy(config.model, config.run.seed), sharded=True)
            seen: set[int] = set()
            entries = []
            # The parameters themselves (``keep_vars``): a tied one is one object under both names.
            for name, tensor in self.trainer.model.state_dict(keep_vars=True).items():
                if id(tensor) in seen:  # a tied weight is sent once, as a checkpoint holds it
                    continue
                seen.add(id(tensor))
                dtype = self.trainer.model_dtype if tensor.is_floating_point() else tensor.dtype
                entries.append(WeightEntry(name, str(dtype).removeprefix("torch."), tuple(tensor.shape)))
            return entries

        def train(self, slices: list[list[list[Rollout]]], weight_version: int, sizes: list[StepSize]) -> Any:
            return self.trainer.train_mini_batches(slices, weight_version, sizes)

        def gather(self, names: list[str]) -> Any:
            import torch

            from scd.training.sharding import gathered

            tensors, moved = gathered(self.trainer.model, names, self.trainer.model_dtype)
            if self.rank != 0:
                return None
            # As numpy bytes: Ray's object store takes an array without pickling it and the caller reads it in
            # place, where a torch tensor is copied on each side.
            return {name: tensor.reshape(-1).view(torch.uint8).numpy() for name, tensor in tensors.items()}, moved

        def capture(self) -> None:
            # A copy in host memory, of its own: training goes on while the writer thread saves it.
            model, optimizer = self.trainer.state_copy()
            self.captured = (model, optimizer) if self.rank == 0 else None

        @ray.method(concurrency_group="writer")
        def write_captured(self, model_path: str, optimizer_path: str) -> tuple[str, str]:
            from scd.model.weights import save_digested

            assert self.captured is not None, "write_captured without a capture"
            model, optimizer = self.captured
            self.captured = None
            return save_digested(model, Path(model_path)), save_digested(optimizer, Path(optimizer_path))

        def load(self, model_path: str, optimizer_path: str) -> dict[str, list[float]]:
            import torch

            return self.trainer.load_state(torch.load(model_path, weights_only=True),
                                           torch.load(optimizer_path, weights_only=True))

    return TrainerRank


class _GroupCapture:
    """A capture submitted to every rank; rank 0 writes it."""

    def __init__(self, group: TrainerGroup, refs: list[Any]) -> None:
        self._group, self._refs = group, refs

    def wait_captured(self) -> None:
        """Until every rank has its part of the capture (the next step starts after it); blocking."""
        self._group.wait_all(self._refs, "a checkpoint's state capture")

    def write(self, model_path: Path, optimizer_path: Path) -> tuple[str, str]:
        self.wait_captured()
        return self._group.wait_all([self._group.ranks[0].write_captured.remote(str(model_path), str(optimizer_path))],
                             "writing a checkpoint's trainer state")[0]

    def release(self) -> None:
        """Nothing lent here: rank 0 drops its copy when it writes it, or keeps one set at most until the next
        capture replaces it."""


@asynccontextmanager
async def open_trainer(config: Config, policy: Policy) -> AsyncIterator[Trainer]:
    """World size 1: a ``GRPOTrainer`` in this process.  Above: a ``TrainerGroup`` (Ray must be up)."""
    if config.trainer.world_size == 1:
        trainer = GRPOTrainer(config, policy)
        metrics.trainer_world_size.set(1)
        metrics.trainer_weight_export_seconds.set(0.0)
        yield trainer
        return
    async with TrainerGroup.open(config) as group:
        yield group


class TrainerGroup:
    """``trainer.world_size`` ranks; the controller's trainer when the world size is above 1."""

    def __init__(self, config: Config, ranks: list[Any], places: list[RankPlace], entries: list[WeightEntry]) -> None:
        self.config = config
        self.ranks = ranks
        self.places = places
        self._entries = entries
        self._entry_of = {entry.name: entry for entry in entries}
        self._export_s = 0.0
        self._skipped_steps = SkippedSteps(config.trainer.max_skipped_steps)
        metrics.trainer_world_size.set(len(ranks))

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Config) -> AsyncIterator[TrainerGroup]:
        """Place, start and connect the ranks; they are killed (and their placement freed) on exit."""
        import ray

        world = config.trainer.world_size
        ranks: list[Any] = []
        async with place_trainer_ranks(config) as rank_options:
            try:
                rank_class = rank_actor()
                for rank, options in enumerate(rank_options):
                    ranks.append(rank_class.options(**options).remote(config, rank, world))
                places = [RankPlace(rank, "(starting)", 0) for rank in range(world)]
                located = await anyio.to_thread.run_sync(wait_all, [r.place.remote() for r in ranks], places,
                                                         "starting")
                places = [RankPlace(rank, ip, pid) for rank, (ip, pid) in enumerate(located)]
                [(host, port)] = await anyio.to_thread.run_sync(
                    wait_all, [ranks[0].rendezvous_address.remote()], places, "choosing the rendezvous address")
                entries = (await anyio.to_thread.run_sync(
                    wait_all, [r.setup.remote(host, port) for r in ranks], places, "joining the process group"))[0]
                log.info("trainer: %d ranks (%s), rendezvous %s:%d", world, "; ".join(map(str, places)), host, port)
                yield cls(config, ranks, places, entries)
            finally:
                for started in ranks:
                    ray.kill(started, no_restart=True)

    def wait_all(self, refs: list[Any], what: str) -> list[Any]:
        return wait_all(refs, self.places, what)

    # ---- the trainer interface ------------------------------------------------------------------

    def step(self, groups: Sequence[Sequence[Rollout]], weight_version: int) -> StepResult:
        # Each mini-batch's whole groups round robin over the ranks, so every rank takes every optimizer step.
        slices = split_mini_batches(groups, self.config.trainer.mini_batches)
        sizes = [step_size(self.config, s) for s in slices]
        shards = [shard_groups(s, len(self.ranks)) for s in slices]
        shares = self.wait_all([rank.train.remote([shard[i] for shard in shards], weight_version, sizes)
                                for i, rank in enumerate(self.ranks)], "training a step")
        result = combine(shares, [r.reward for g in groups for r in g])
        publish(result)
        self._skipped_steps.after(result, groups, weight_version)
        return result

    def capture_state(self) -> _GroupCapture:
        return _GroupCapture(self, [rank.capture.remote() for rank in self.ranks])

    def load_state_files(self, model_path: Path, optimizer_path: Path) -> dict[str, list[float]]:
        return self.wait_all([rank.load.remote(str(model_path), str(optimizer_path)) for rank in self.ranks],
                             f"loading {model_path.parent}")[0]

    def live_weights(self) -> ChunkedWeights:
        self._export_s = 0.0
        return ChunkedWeights(self._entries, self._gather)

    def _gather(self, names: list[str]) -> tuple[dict[str, Any], int]:
        started = time.monotonic()
        as_bytes, moved = self.wait_all([rank.gather.remote(names) for rank in self.ranks], "exporting weights")[0]
        tensors = {name: over_object_store(as_bytes[name], self._entry_of[name]) for name in names}
        self._export_s += time.monotonic() - started
        metrics.trainer_weight_export_seconds.set(self._export_s)
        return tensors, moved

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(world_size=len(self.ranks), last_export_s=self._export_s)
