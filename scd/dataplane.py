"""TransferQueue on Ray: the only place scd touches TQ.

Every call is bounded by ``data_plane.call_timeout_s`` (TQ's controller calls
have none, so a dead TQ would hang the caller), and every read checks that each
row asked for came back (``kv_batch_get`` silently drops missing keys).

Rows are put as jagged nested tensors built from separate per-row tensors.
TQ stores each row as a view of what it received; packing per-row buffers keeps
a snapshot about the size of its payload and lets a clear free its row.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

from scd.config import DataPlaneConfig
from scd.errors import DataPlaneError, ShortRead
from scd.records import Rollout

log = logging.getLogger(__name__)
T = TypeVar("T")

# TQ calls torch.set_num_threads(TQ_NUM_THREADS) around every put/get, process-wide.
# Pin it to what training uses so TQ traffic does not re-thread the trainer.
os.environ.setdefault("TQ_NUM_THREADS", "1")
# Ray's core worker otherwise installs absl's failure-signal handler in this process, which
# turns the SIGTERM we drain on into an abort.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")



class DataPlane:
    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        self.partition = config.partition
        self.data_ops = 0  # restore refuses to load into a data plane that has served any
        # What /healthz reports: did TQ fail to answer the last call within call_timeout_s?
        self.last_call_timed_out = False

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
        # No TQ tags: per-row scalars live in the replay index, and tags would be shipped back
        # with every key by kv_list, the inventory check inside the checkpoint's exclusive hold.
        await self._call("put", lambda: tq.async_kv_batch_put(
            keys=list(sample_ids), partition_id=self.partition, fields=fields))

    async def get_rows(self, sample_ids: Sequence[str]) -> Any:
        """The rows for ``sample_ids`` in that order, as a TensorDict; all of them or an error."""
        import transfer_queue as tq

        data = await self._call("get", lambda: tq.async_kv_batch_get(
            keys=list(sample_ids), partition_id=self.partition))
        got = 0 if data is None else data.batch_size[0]
        if got != len(sample_ids):
            raise ShortRead(f"TransferQueue returned {got} of {len(sample_ids)} rows asked for "
                                 f"(first asked: {list(sample_ids)[:3]})")
        return data

    async def clear(self, sample_ids: Sequence[str]) -> None:
        import transfer_queue as tq

        await self._call("clear", lambda: tq.async_kv_clear(list(sample_ids), self.partition))

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


def pack_rows(rows: Sequence[Rollout]) -> Any:
    """Rows as jagged nested tensors of separate per-row buffers (see the module docstring)."""
    from tensordict import TensorDict

    def jagged(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor([t.clone() for t in tensors], layout=torch.jagged)

    return TensorDict({
        "input_ids": jagged([r.input_ids for r in rows]),
        "logprobs": jagged([r.logprobs.to(torch.float32) for r in rows]),
    }, batch_size=[len(rows)])


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
