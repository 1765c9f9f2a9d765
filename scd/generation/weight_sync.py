"""Weights into paused vLLM engines: the transfer, retried once, then a reload from a file.

``generation.vllm.weight_sync = "transfer"`` broadcasts the trainer's own tensors
once to every worker of every engine (``scd.generation.weight_transfer``);
``"reload"`` writes safetensors to a staging directory that each engine reloads
in place (tensors cannot cross vLLM's process boundary by value).

An attempt that fails part-way leaves the engines holding a mix of versions:
every engine is reset (scd and the workers leave the transfer group, half-loaded
layers are finalized), then the next attempt runs: the transfer once more on a
fresh group, then a reload.  If nothing works, ``EngineFailed`` names the engines
left mixed (exit 1); checkpoints are untouched and the next start restores.
``scd_weight_sync_failures_total{path}`` counts the failed attempts.
"""

from __future__ import annotations

import functools
import logging
import shutil
import socket
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import anyio
import torch

from scd import faults
from scd.config import Config
from scd.generation.vllm_engine import RESTART, CallFailed, EngineFailed, VLLMEngine, on_every_engine
from scd.telemetry import metrics

log = logging.getLogger(__name__)

WeightSyncPath = Literal["transfer", "reload"]


class WeightSync:
    """Delivers whole weight versions to a fixed set of engines, which the caller keeps paused meanwhile."""

    def __init__(self, config: Config, engines: Sequence[VLLMEngine]) -> None:
        from scd.generation.weight_transfer import Sender

        cfg = config.generation.vllm
        self._engines = engines
        self._path: WeightSyncPath = cfg.weight_sync
        self._timeout_s = cfg.weight_sync_timeout_s
        # scd is rank 0 of the transfer group, sending from where the trainer's weights are: NCCL from a
        # GPU to GPUs; gloo from or to host memory (a GPU engine then copies what it receives to its GPU).
        trainer_device = torch.device(config.trainer.device)
        nccl = engines[0].devices.kind == "cuda" and trainer_device.type == "cuda"
        self._dist_backend = "nccl" if nccl else "gloo"
        self._sender = Sender(trainer_device if nccl else torch.device("cpu"))
        # Reload writes here: the configured path, and the fallback of a failed transfer.
        self._staging = Path(tempfile.mkdtemp(prefix="scd-weights-", dir=_staging_root()))

    async def deliver(self, weights: Mapping[str, torch.Tensor], path: WeightSyncPath | None = None) -> WeightSyncPath:
        """Move ``weights`` into every paused engine by ``path`` (generation.vllm.weight_sync unless given);
        returns the path that did.  A failed attempt is followed by a reset and the next attempt: the
        transfer once more, then a reload."""
        first = path or self._path
        attempts: tuple[WeightSyncPath, ...] = ("transfer", "transfer", "reload") if first == "transfer" \
            else ("reload", "reload")
        failed: list[str] = []
        unsynced: list[VLLMEngine] = []
        for attempt in attempts:
            try:
                with anyio.fail_after(self._timeout_s):
                    await (self._transfer(weights) if attempt == "transfer" else self._reload(weights))
            except CallFailed as exc:
                reason, unsynced = str(exc), exc.engines_left_mixed(self._engines)
            except TimeoutError:
                reason = f"no end within generation.vllm.weight_sync_timeout_s = {self._timeout_s:g}s"
                unsynced = list(self._engines)
            else:
                if failed:
                    log.warning("weight sync delivered by %s after: %s", attempt, "; ".join(failed))
                return attempt
            failed.append(f"{attempt}: {reason}")
            metrics.weight_sync_failures.labels(attempt).inc()
            log.warning("weight sync by %s failed, the engines stay paused: %s", attempt, reason)
            await self._reset()
        raise EngineFailed(f"{', '.join(e.name for e in unsynced)} hold(s) no whole weight version and stay(s) "
                           f"paused: {'; then '.join(failed)}. {RESTART}")

    async def _transfer(self, weights: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from scd.generation.weight_transfer import Layout

        layout = Layout.of(weights)
        if not self._sender.connected:
            await self._connect()
        await on_every_engine(self._engines, "start_weight_update", lambda e: e.llm.start_weight_update())
        request = WeightTransferUpdateRequest(update_info=layout.update_info())
        await on_every_engine(
            self._engines, "update_weights", lambda e: e.llm.update_weights(request),
            sender=functools.partial(self._sender.send, weights, layout,
                                     functools.partial(faults.hit, "mid_weight_broadcast")))
        await on_every_engine(self._engines, "finish_weight_update", lambda e: e.llm.finish_weight_update())

    async def _connect(self) -> None:
        """One group for every worker of every engine, scd as rank 0 (it holds the rendezvous store)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from scd.generation.weight_transfer import LOOPBACK_HOST, GroupInfo

        listener = socket.create_server((LOOPBACK_HOST, 0))  # the kernel picks a free port
        try:
            group = GroupInfo(host=LOOPBACK_HOST, port=listener.getsockname()[1], rank_offset=0,
                              world_size=1 + sum(e.devices.workers for e in self._engines),
                              dist_backend=self._dist_backend, timeout_s=self._timeout_s)
            await on_every_engine(
                self._engines, "init_weight_transfer_engine",
                lambda e: e.llm.init_weight_transfer_engine(WeightTransferInitRequest(
                    init_info={**vars(group), "rank_offset": e.rank_offset})),
                sender=functools.partial(self._sender.connect, group, listener))
        finally:
            listener.close()  # a no-op once the rendezvous store owns it

    async def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from scd.generation.weight_transfer import Layout

        def write() -> None:
            # A file per chunk: a trainer group's weights arrive a layer at a time, and no more
            # than a chunk of them is held here.
            for stale in self._staging.glob("*.safetensors"):
                stale.unlink()
            layout = Layout.of(weights)
            for k, chunk in enumerate(layout.chunks()):
                save_file({layout.names[i]: weights[layout.names[i]].detach().contiguous() for i in chunk},
                          str(self._staging / f"model-{k:05d}.safetensors"))

        try:
            faults.hit("during_weight_reload")
            await anyio.to_thread.run_sync(write)
        except OSError as exc:
            raise CallFailed(f"writing the weights to {self._staging}", {None: exc}) from exc
        await on_every_engine(
            self._engines, "reload_weights",
            lambda e: e.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging)}))

    async def _reset(self) -> None:
        """After a failed attempt: scd leaves the transfer group; every engine finalizes its half-loaded
        layers, closes its update session and leaves the group, so that the next attempt starts clean."""
        self._sender.close()
        try:
            # An engine may still be inside the failed call until its side of the group times out.
            with anyio.fail_after(2 * self._timeout_s):
                await on_every_engine(self._engines, "scd_reset_weight_update",
                                      lambda e: e.llm.collective_rpc("scd_reset_weight_update"))
        except (CallFailed, TimeoutError) as exc:
            raise EngineFailed(f"after a failed weight sync the engines could not be brought back to a clean "
                               f"state ({exc or 'timed out'}); they stay paused. {RESTART}") from None

    def close(self) -> None:
        """Leave the transfer group and remove the staging directory."""
        self._sender.close()
        shutil.rmtree(self._staging, ignore_errors=True)


def _staging_root() -> str | None:
    """tmpfs when there is one: the weights are written and read back once per step."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
