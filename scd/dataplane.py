"""TransferQueue on Ray: the only place scd touches TQ.

Every call is bounded by ``data_plane.call_timeout_s`` (TQ's controller calls
have none, so a dead TQ would hang the caller), and every read checks that each
row asked for came back (``kv_batch_get`` silently drops missing keys).

One TQ key per group (its group id), holding one ``bytes`` value
(``encode_group``: the sibling count, each sibling's token and logprob counts,
then every int64 token id and every float32 logprob).  TQ's storage unit pickles
its values to save them and its controller pickles a record per key: a
``bytes`` value pickles at disk speed where a torch tensor costs ~100 µs in
torch's storage reducer, and a key per group is 8x fewer records.  At 80k rows
TQ's save took 15-22 s as per-row jagged tensors, 0.6-1.3 s as per-row bytes
and ~0.1 s as per-group bytes; a put or get queued behind a save (a storage
unit serves one request at a time) waits that much less.  A value owns its
memory, so a clear frees it and a snapshot is about the size of its payload.
Siblings stay addressable inside a group (``GroupMeta.sample_ids``).

A sibling that finishes while others of its group still run is staged in a
partition of its own (``<partition>.staging``) under ``staged_key`` (group id,
sibling index, weight version; ``encode_sibling``), so a crash keeps it.  TQ
0.1.11 cannot move a value between keys or partitions, so when its group
completes the group's value is written whole (a second copy of the staged
siblings' bytes) and the staged keys are cleared.  Keys of both partitions are
disjoint by form (a staged key has a ``/``), so one inventory, one save window
and one list of owed clears cover both.

A TQ save runs outside the checkpoint's exclusive hold, inside a ``SaveWindow``:
TQ saves its controller's metadata first and its storage units after, and a put
writes the units first and the controller after.  So a put racing the save
yields a complete row or unlisted orphan data, never a listed row without data;
only a clear landing between the two halves could.  While the window is open,
clears are therefore deferred (the snapshot keeps every row of the cut), and
every key put is recorded: the bundle names those rows as not of the cut, and
restore clears them.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import numpy as np
import torch

from scd import faults
from scd.cluster import bounded_thread
from scd.config import DataPlaneConfig
from scd.errors import ConfigError, DataPlaneError, InvariantViolation, ShortRead
from scd.records import Completion, FinishReason, Rollout
from scd.telemetry import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

# TQ calls torch.set_num_threads(TQ_NUM_THREADS) around every put/get, process-wide.
# Pin it to what training uses so TQ traffic does not re-thread the trainer.
os.environ.setdefault("TQ_NUM_THREADS", "1")


@dataclass(slots=True)
class SaveWindow:
    """What happened to TQ's rows while its save ran."""

    # Keys (group ids) that may be in TQ, and so in the snapshot, without being in the cut:
    # every key put while the window was open, and clears still owed when it opened.
    uncut: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where TQ's actors run: node IPs of its controller and of each storage unit."""

    controller: str
    storage_units: list[str]


def check_layout(config: DataPlaneConfig, running: Any) -> Placement:
    """The running TQ's storage layout must be the configured one; TQ itself ignores the config of a
    process that attaches to it, so a mismatch would otherwise pass silently."""
    storage = running.backend.SimpleStorage
    units = int(storage.num_data_storage_units)
    if units != config.storage_units:
        raise ConfigError("data_plane.storage_units",
                          f"the running TransferQueue has {units} storage unit(s); this config asks for "
                          f"{config.storage_units}. Set it to {units} to attach, or start a new TQ")
    resource = storage.get("required_node_resource") or ""
    if resource != config.required_node_resource:
        raise ConfigError("data_plane.required_node_resource",
                          f"the running TransferQueue placed its storage units on nodes with "
                          f"{resource or 'any resource'!r}; this config asks for "
                          f"{config.required_node_resource or 'any node'!r}")
    return Placement(controller=running.controller.zmq_info.ip,
                     storage_units=sorted(info.ip for info in storage.zmq_info.values()))


class DataPlane:
    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        self.partition = config.partition
        self.staging = f"{config.partition}.staging"
        self.data_ops = 0  # restore refuses to load into a data plane that has served any
        # What /healthz reports: did TQ fail to answer the last call within call_timeout_s?
        self.last_call_timed_out = False
        self._window: SaveWindow | None = None
        self._owed_clears: list[str] = []  # deferred during a save, or left by a clear that failed
        self.placement = Placement(controller="", storage_units=[])

    @classmethod
    @asynccontextmanager
    async def open(cls, config: DataPlaneConfig) -> AsyncIterator[DataPlane]:
        """Start (or attach to) TQ on the Ray this process runs (``scd.cluster``); close only a TQ it started."""
        import ray
        import transfer_queue as tq
        from transfer_queue import interface as tq_interface

        conf = {"backend": {"SimpleStorage": {"num_data_storage_units": config.storage_units,
                                              "required_node_resource": config.required_node_resource or None}}}
        attached_already = tq_interface._TQ_CLIENT is not None
        owns_tq = False
        try:
            await bounded_thread(config.startup_timeout_s, "tq.init", lambda: tq.init(conf))
            # tq.close() kills the controller even from a process that merely attached: close only ours.
            owns_tq = not attached_already and tq_interface._TQ_STORAGE is not None
            running = await bounded_thread(config.startup_timeout_s, "TQ's config", lambda: ray.get(
                tq_interface._TQ_CONTROLLER.get_config.remote()))
            dataplane = cls(config)
            dataplane.placement = check_layout(config, running)
            log.info("TransferQueue: controller on %s, storage units on %s", dataplane.placement.controller,
                     ", ".join(dataplane.placement.storage_units))
            yield dataplane
        finally:
            if owns_tq:
                with anyio.CancelScope(shield=True):
                    await bounded_thread(config.call_timeout_s, "tq.close", tq.close, swallow=True)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        self.data_ops += 1
        try:
            result = await call_within(self.config.call_timeout_s, fn)
        except TimeoutError:
            self.last_call_timed_out = True
            raise DataPlaneError(f"TransferQueue {what} timed out after {self.config.call_timeout_s}s; "
                                 f"is TQ (Ray) alive? {self._where()}") from None
        self.last_call_timed_out = False
        return result

    async def _blocking(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            await bounded_thread(self.config.call_timeout_s, what, fn)
        except DataPlaneError as exc:
            self.last_call_timed_out = True
            raise DataPlaneError(f"{exc} {self._where()}") from None
        self.last_call_timed_out = False

    def _where(self) -> str:
        return (f"(its controller runs on node {self.placement.controller}, its storage units on "
                f"{', '.join(sorted(set(self.placement.storage_units)))})")

    async def put_group(self, key: str, rows: Sequence[Rollout]) -> None:
        """Store one group's rows under its key (the group id)."""
        await self._put_values([key], self.partition, [encode_group(rows)])

    async def get_groups(self, keys: Sequence[str]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each group's (input_ids, logprobs) rows, groups in the order of ``keys``; all of them or an error."""
        return [decode_group(raw) for raw in await self._get_values(keys, self.partition, "groups")]

    async def put_siblings(self, keys: Sequence[str], completions: Sequence[Completion]) -> None:
        """Stage finished siblings, each under its ``staged_key``, in one put to the staging partition."""
        await self._put_values(keys, self.staging, [encode_sibling(c) for c in completions])

    async def get_siblings(self, keys: Sequence[str]) -> list[tuple[list[int], list[float], FinishReason]]:
        """Staged siblings' (token ids, logprobs, finish reason), in the order of ``keys``; all or an error."""
        if not keys:
            return []
        return [decode_sibling(raw) for raw in await self._get_values(keys, self.staging, "staged siblings")]

    async def _put_values(self, keys: Sequence[str], partition: str, raws: list[bytes]) -> None:
        import transfer_queue as tq
        from tensordict import NonTensorStack, TensorDict

        fields = TensorDict({GROUP_FIELD: NonTensorStack(*raws)}, batch_size=[len(raws)])
        if self._window is not None:
            # Before the put: a put that fails half-way may still have listed its keys.
            self._window.uncut.update(keys)
        # No TQ tags: per-group scalars live in the replay index, and tags would be shipped back
        # with every key by kv_list, the inventory check after every TQ save.
        await self._call("put", lambda: tq.async_kv_batch_put(keys=list(keys), partition_id=partition,
                                                               fields=fields))
        if self._window is not None:
            faults.hit("post_cut_commit")

    async def _get_values(self, keys: Sequence[str], partition: str, what: str) -> list[bytes]:
        import transfer_queue as tq

        data = await self._call("get", lambda: tq.async_kv_batch_get(keys=list(keys), partition_id=partition))
        got = 0 if data is None else data.batch_size[0]
        if got != len(keys):
            raise ShortRead(f"TransferQueue returned {got} of {len(keys)} {what} asked for "
                            f"(first asked: {list(keys)[:3]})")
        return data.get(GROUP_FIELD).tolist()

    def _partition_of(self, key: str) -> str:
        return self.staging if "/" in key else self.partition

    async def clear(self, keys: Sequence[str]) -> None:
        """Clear consumed or evicted groups, or staged siblings; deferred while a save window is open."""
        self._owe(keys)
        if self._window is None:
            await self.clear_owed()

    def clear_later(self, keys: Sequence[str]) -> None:
        """Owe the clear of ``keys`` to the next clear (or save window close) rather than pay a TQ
        round trip now: for a completed group's staged siblings, whose bytes its value holds.  A
        save window that opens meanwhile counts them as uncut, so they never break an inventory."""
        self._owe(keys)

    def _owe(self, keys: Sequence[str]) -> None:
        self._owed_clears.extend(keys)
        metrics.owed_clears.set(len(self._owed_clears))

    async def discard_failed_put(self, keys: Sequence[str]) -> None:
        """Clear what a failed put may have written, at once even inside a save window.

        The keys are put again when their group or sibling is regenerated; a deferred clear
        would land after that put and delete the new rows.  They are in the window's ``uncut``.
        """

        await self._clear_now(keys)

    async def _clear_now(self, keys: Sequence[str]) -> None:
        """One TQ clear per partition the keys fall in."""
        import transfer_queue as tq

        for partition in (self.partition, self.staging):
            inside = [k for k in keys if self._partition_of(k) == partition]
            if inside:
                await self._call("clear", lambda p=partition, k=inside: tq.async_kv_clear(k, p))

    async def clear_owed(self) -> None:
        """Carry out every clear owed (deferred by a save window, or by ``clear_later``) now."""
        owed, self._owed_clears = self._owed_clears, []
        if not owed:
            return
        try:
            await self._clear_now(owed)
        except BaseException:
            # Still owed: the next clear (or save window) carries them, so no row is leaked.
            self._owed_clears[:0] = owed
            raise
        finally:
            metrics.owed_clears.set(len(self._owed_clears))

    def open_save_window(self) -> SaveWindow:
        """From now until ``close_save_window``, clears are deferred and puts recorded (module docstring).

        Called under the checkpoint's exclusive hold, so no mutation sits between the cut and the window.
        """
        if self._window is not None:
            raise InvariantViolation("a TQ save window is already open")
        self._window = SaveWindow(uncut=set(self._owed_clears))
        return self._window

    async def close_save_window(self) -> None:
        """Close the window and carry out the clears it deferred.

        A clear that fails here fails nothing else: the save this window served is good or failed on
        its own account, and the keys stay owed, carried by the next clear (a window opening
        meanwhile counts them uncut).  It is logged and counted (``scd_owed_clear_failures_total``).
        """
        self._window = None
        try:
            faults.hit("during_deferred_clear")
            await self.clear_owed()
        except Exception as exc:
            metrics.owed_clear_failures.inc()
            log.warning("clearing %d TQ keys owed at the close of a save window failed (%s); they stay owed and "
                        "the next clear retries them", len(self._owed_clears), exc)

    async def list_keys(self) -> set[str]:
        """TQ's inventory: every group id in the partition and every staged sibling's key."""
        import transfer_queue as tq

        async def both() -> set[str]:
            keys: set[str] = set()
            for partition in (self.partition, self.staging):
                keys.update((await tq.async_kv_list(partition)).get(partition, {}))
            return keys

        return await self._call("list", both)

    async def keys_per_partition(self) -> dict[str, int]:
        """How many keys each partition TQ holds has: scd's two and any other's (a TQ scd attached to)."""
        import transfer_queue as tq

        listed = await self._call("list", lambda: tq.async_kv_list())
        return {partition: len(keys) for partition, keys in listed.items()}

    async def clear_all(self) -> None:
        ids = await self.list_keys()
        if ids:
            await self.clear(sorted(ids))

    async def save_snapshot(self, directory: Path) -> None:
        import transfer_queue as tq

        await self._blocking("save_checkpoint", lambda: tq.save_checkpoint(directory))

    async def load_snapshot(self, directory: Path) -> None:
        import transfer_queue as tq

        await self._blocking("load_checkpoint", lambda: tq.load_checkpoint(directory))


GROUP_FIELD = "group"
_COUNT = struct.Struct("<q")


def encode_group(rows: Sequence[Rollout]) -> bytes:
    ids = [r.input_ids.to(torch.int64).contiguous().numpy().astype("<i8", copy=False) for r in rows]
    logprobs = [r.logprobs.to(torch.float32).contiguous().numpy().astype("<f4", copy=False) for r in rows]
    counts = np.array([len(rows), *map(len, ids), *map(len, logprobs)], dtype="<i8")
    return b"".join([counts.tobytes(), *(a.tobytes() for a in ids), *(a.tobytes() for a in logprobs)])


def decode_group(raw: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A stored group's (input_ids, logprobs) per sibling, in memory of their own."""
    (n,) = _COUNT.unpack_from(raw)
    counts = np.frombuffer(raw, dtype="<i8", count=2 * n, offset=_COUNT.size)
    id_counts, logprob_counts = counts[:n].tolist(), counts[n:].tolist()
    at = _COUNT.size * (1 + 2 * n)
    if len(raw) != at + 8 * sum(id_counts) + 4 * sum(logprob_counts):
        raise ShortRead(f"a TransferQueue group of {len(raw)} bytes does not hold the {n} siblings it declares")
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<i8", count=sum(id_counts), offset=at).astype(np.int64))
    at += 8 * sum(id_counts)
    logprobs = torch.from_numpy(
        np.frombuffer(raw, dtype="<f4", count=sum(logprob_counts), offset=at).astype(np.float32))
    return list(zip(ids.split(id_counts), logprobs.split(logprob_counts), strict=True))


_SIBLING_HEADER = struct.Struct("<qq")  # token count, finish reason (index into _FINISH_CODES)
# Append only: a staged sibling's code must mean the same to a later scd.
_FINISH_CODES = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.EOS)


def encode_sibling(completion: Completion) -> bytes:
    """A staged sibling: its completion tokens (int64) and logprobs (float32); the ledger keeps its version."""
    header = _SIBLING_HEADER.pack(len(completion.token_ids), _FINISH_CODES.index(completion.finish_reason))
    return b"".join([header, np.asarray(completion.token_ids, dtype="<i8").tobytes(),
                     np.asarray(completion.logprobs, dtype="<f4").tobytes()])


def decode_sibling(raw: bytes) -> tuple[list[int], list[float], FinishReason]:
    n, finish = _SIBLING_HEADER.unpack_from(raw)
    at = _SIBLING_HEADER.size
    if len(raw) != at + 12 * n or not 0 <= finish < len(_FINISH_CODES):
        raise ShortRead(f"a staged sibling of {len(raw)} bytes does not hold the {n} tokens it declares")
    ids = np.frombuffer(raw, dtype="<i8", count=n, offset=at).tolist()
    logprobs = np.frombuffer(raw, dtype="<f4", count=n, offset=at + 8 * n).tolist()
    return ids, logprobs, _FINISH_CODES[finish]


async def call_within(timeout_s: float, fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()``, or TimeoutError once ``timeout_s`` has passed.

    Unlike ``anyio.fail_after``, a deadline that fired is a timeout whatever the error it
    produced looks like.  TQ fans a call out to its storage units with ``asyncio.gather``, and
    on Python 3.11 a cancelled gather raises a CancelledError built from its *last* child: one
    without anyio's cancel-scope message when that child had already finished (a unit that
    answered or failed while another hung).  anyio cannot then tell its own deadline from a
    foreign cancellation and lets the bare CancelledError escape.  Converting it is safe:
    a cancellation of an enclosing scope is level-triggered and lands again at the next await.
    """
    deadline = anyio.CancelScope(deadline=anyio.current_time() + timeout_s)
    try:
        with deadline:
            return await fn()
    except anyio.get_cancelled_exc_class():
        if not deadline.cancel_called:
            raise
    raise TimeoutError(f"no answer within {timeout_s}s")
