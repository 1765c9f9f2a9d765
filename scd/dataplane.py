"""TransferQueue on Ray: the only place scd touches TQ.

Every call is bounded by ``data_plane.call_timeout_s`` (TQ's controller calls
have none, so a dead TQ would hang the caller), and every read checks that each
row asked for came back (``kv_batch_get`` silently drops missing keys).

Each row is one ``bytes`` value (``encode_row``: two lengths, the int64 token
ids, the float32 logprobs) in one field.  TQ's storage unit pickles its rows to
save them, and a ``bytes`` value pickles at disk speed where a torch tensor
costs ~100 µs in torch's storage reducer: at 80k rows the save took 18-21 s as
jagged nested tensors and 0.7-1.3 s as bytes, the load 28 s and 0.3 s, and a
put or get queued behind a save waits that long (bench/results, README).  A
``bytes`` row owns its memory, so a clear frees it and a snapshot is about
the size of its payload.

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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import numpy as np
import torch

from scd import faults
from scd.config import DataPlaneConfig
from scd.errors import DataPlaneError, InvariantViolation, ShortRead
from scd.records import Rollout

log = logging.getLogger(__name__)
T = TypeVar("T")

# TQ calls torch.set_num_threads(TQ_NUM_THREADS) around every put/get, process-wide.
# Pin it to what training uses so TQ traffic does not re-thread the trainer.
os.environ.setdefault("TQ_NUM_THREADS", "1")
# Ray's core worker otherwise installs absl's failure-signal handler in this process, which
# turns the SIGTERM we drain on into an abort.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")



@dataclass(slots=True)
class SaveWindow:
    """What happened to TQ's rows while its save ran."""

    # Keys that may be in TQ (and so in the snapshot) without being in the cut: every key put
    # while the window was open, and clears still owed when it opened.
    uncut: set[str] = field(default_factory=set)
    deferred_clears: int = 0
    opened_at: float = field(default_factory=time.monotonic)


class DataPlane:
    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        self.partition = config.partition
        self.data_ops = 0  # restore refuses to load into a data plane that has served any
        # What /healthz reports: did TQ fail to answer the last call within call_timeout_s?
        self.last_call_timed_out = False
        self._window: SaveWindow | None = None
        self._owed_clears: list[str] = []  # deferred during a save, or left by a clear that failed

    @classmethod
    @asynccontextmanager
    async def open(cls, config: DataPlaneConfig) -> AsyncIterator[DataPlane]:
        """Start (or join) Ray, start (or attach to) TQ; tear down only what this process started."""
        import ray
        import transfer_queue as tq
        from transfer_queue import interface as tq_interface

        started_ray = False
        if not ray.is_initialized():
            if config.ray.address:
                await _bounded_thread(config.startup_timeout_s, "ray.init",
                                      lambda: ray.init(address=config.ray.address, log_to_driver=False))
            else:
                # Loopback node IP keeps TQ's zmq sockets (pickled messages) off the network.
                await _bounded_thread(config.startup_timeout_s, "ray.init", lambda: ray.init(
                    num_cpus=config.ray.num_cpus, include_dashboard=False, log_to_driver=False,
                    _node_ip_address="127.0.0.1", logging_level=logging.WARNING))
            started_ray = True
        conf = {"backend": {"SimpleStorage": {"num_data_storage_units": config.storage_units}}}
        attached_already = tq_interface._TQ_CLIENT is not None
        await _bounded_thread(config.startup_timeout_s, "tq.init", lambda: tq.init(conf))
        # tq.close() kills the controller even from a process that merely attached: close only ours.
        owns_tq = not attached_already and tq_interface._TQ_STORAGE is not None
        try:
            yield cls(config)
        finally:
            with anyio.CancelScope(shield=True):
                if owns_tq:
                    await _bounded_thread(config.call_timeout_s, "tq.close", tq.close, swallow=True)
                if started_ray:
                    await _bounded_thread(config.call_timeout_s, "ray.shutdown", ray.shutdown, swallow=True)

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        self.data_ops += 1
        try:
            with anyio.fail_after(self.config.call_timeout_s):
                result = await fn()
        except TimeoutError:
            self.last_call_timed_out = True
            raise DataPlaneError(f"TransferQueue {what} timed out after {self.config.call_timeout_s}s; "
                                 "is TQ (Ray) alive?") from None
        self.last_call_timed_out = False
        return result

    async def _blocking(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            await _bounded_thread(self.config.call_timeout_s, what, fn)
        except DataPlaneError:
            self.last_call_timed_out = True
            raise
        self.last_call_timed_out = False

    async def put_rows(self, sample_ids: Sequence[str], rows: Sequence[Rollout]) -> None:
        import transfer_queue as tq

        fields = pack_rows(rows)
        if self._window is not None:
            # Before the put: a put that fails half-way may still have listed its keys.
            self._window.uncut.update(sample_ids)
        # No TQ tags: per-row scalars live in the replay index, and tags would be shipped back
        # with every key by kv_list, the inventory check inside the checkpoint's exclusive hold.
        await self._call("put", lambda: tq.async_kv_batch_put(
            keys=list(sample_ids), partition_id=self.partition, fields=fields))
        if self._window is not None:
            faults.hit("post_cut_commit")

    async def get_rows(self, sample_ids: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, logprobs) for ``sample_ids``, in that order; all of them or an error."""
        import transfer_queue as tq

        data = await self._call("get", lambda: tq.async_kv_batch_get(
            keys=list(sample_ids), partition_id=self.partition))
        got = 0 if data is None else data.batch_size[0]
        if got != len(sample_ids):
            raise ShortRead(f"TransferQueue returned {got} of {len(sample_ids)} rows asked for "
                                 f"(first asked: {list(sample_ids)[:3]})")
        return [decode_row(raw) for raw in data.get(ROW_FIELD).tolist()]

    async def clear(self, sample_ids: Sequence[str]) -> None:
        """Clear consumed or evicted rows; deferred while a save window is open."""
        self._owed_clears.extend(sample_ids)
        if self._window is not None:
            self._window.deferred_clears += len(sample_ids)
            return
        await self._clear_owed()

    async def discard_failed_put(self, sample_ids: Sequence[str]) -> None:
        """Clear what a failed put may have written, at once even inside a save window.

        Those keys are put again when the group is regenerated; a deferred clear would
        land after that put and delete the new rows.  They are in the window's ``uncut``.
        """
        import transfer_queue as tq

        await self._call("clear", lambda: tq.async_kv_clear(list(sample_ids), self.partition))

    async def _clear_owed(self) -> None:
        import transfer_queue as tq

        owed, self._owed_clears = self._owed_clears, []
        if not owed:
            return
        try:
            await self._call("clear", lambda: tq.async_kv_clear(owed, self.partition))
        except BaseException:
            # Still owed: the next clear (or save window) carries them, so no row is leaked.
            self._owed_clears[:0] = owed
            raise

    def open_save_window(self) -> SaveWindow:
        """From now until ``close_save_window``, clears are deferred and puts recorded (module docstring).

        Called under the checkpoint's exclusive hold, so no mutation sits between the cut and the window.
        """
        if self._window is not None:
            raise InvariantViolation("a TQ save window is already open")
        self._window = SaveWindow(uncut=set(self._owed_clears))
        return self._window

    async def close_save_window(self) -> None:
        """Close the window and carry out the clears it deferred."""
        self._window = None
        await self._clear_owed()

    async def list_ids(self) -> set[str]:
        """TQ's canonical inventory: every key in the partition."""
        import transfer_queue as tq

        listing = await self._call("list", lambda: tq.async_kv_list(self.partition))
        return set(listing.get(self.partition, {}))

    async def clear_all(self) -> None:
        ids = await self.list_ids()
        if ids:
            await self.clear(sorted(ids))

    async def save_snapshot(self, directory: Path) -> None:
        import transfer_queue as tq

        await self._blocking("save_checkpoint", lambda: tq.save_checkpoint(directory))

    async def load_snapshot(self, directory: Path) -> None:
        import transfer_queue as tq

        await self._blocking("load_checkpoint", lambda: tq.load_checkpoint(directory))


ROW_FIELD = "row"
_ROW_HEADER = struct.Struct("<qq")  # token count, logprob count


def encode_row(row: Rollout) -> bytes:
    ids = row.input_ids.to(torch.int64).contiguous().numpy().astype("<i8", copy=False)
    logprobs = row.logprobs.to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return _ROW_HEADER.pack(len(ids), len(logprobs)) + ids.tobytes() + logprobs.tobytes()


def decode_row(raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, logprobs) of one stored row, in memory of their own."""
    n_ids, n_logprobs = _ROW_HEADER.unpack_from(raw)
    if len(raw) != _ROW_HEADER.size + 8 * n_ids + 4 * n_logprobs:
        raise ShortRead(f"a TransferQueue row of {len(raw)} bytes does not hold {n_ids} token ids and "
                        f"{n_logprobs} logprobs")
    ids = np.frombuffer(raw, dtype="<i8", count=n_ids, offset=_ROW_HEADER.size)
    logprobs = np.frombuffer(raw, dtype="<f4", count=n_logprobs, offset=_ROW_HEADER.size + 8 * n_ids)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logprobs.astype(np.float32))


def pack_rows(rows: Sequence[Rollout]) -> Any:
    from tensordict import NonTensorStack, TensorDict

    return TensorDict({ROW_FIELD: NonTensorStack(*[encode_row(r) for r in rows])}, batch_size=[len(rows)])


async def _bounded_thread(timeout_s: float, what: str, fn: Callable[[], T], swallow: bool = False) -> T | None:
    """Run a blocking TQ/Ray call in a worker thread, abandoned (and reported) past ``timeout_s``."""
    start = time.monotonic()
    try:
        with anyio.fail_after(timeout_s):
            return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    except TimeoutError:
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
