"""FSDP2 inside one trainer rank: sharding the model, and its state gathered or loaded whole.

A rank's process group is the default one (``TrainerGroup`` sets it up).  A bundle holds the whole,
unsharded state, with the optimizer's keyed by parameter index as a plain ``optimizer.state_dict()``
is, so one bundle restores at any world size, in scd's process or on ranks.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import orjson
import torch
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.futures import Future

from scd.config import TrainerConfig
from scd.errors import ConfigError
from scd.model.policy import Policy


def shard_model(model: nn.Module, policy: Policy, config: TrainerConfig, compute: torch.dtype,
                master: torch.dtype) -> int:
    """``fully_shard`` each decoder layer, then the root, over ``master`` weights that compute in ``compute``
    (gradients reduced in ``trainer.reduce_dtype``, else in the masters' dtype); returns the world size."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reduce = getattr(torch, config.reduce_dtype) if config.reduce_dtype else master
    precision = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    for layer in policy.decoder_layers(model):
        fully_shard(layer, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    return dist.get_world_size()


class SliceReader(HuggingFaceStorageReader):
    """DCP's ``HuggingFaceStorageReader``, reading a rank's rows of each tensor with ``pread`` into its shard.

    torch's own reads through ``safe_open``'s memory map: the pages a rank touches count in its resident memory
    until the file is closed, a second copy of its shards.  A slice of a tensor's leading rows (FSDP2 shards dim 0)
    is one byte range of the file: read into the shard itself when the dtypes agree, else through a buffer of the
    slice.  Any other slice is read through ``safe_open`` as torch's reader does.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, items in per_file.items():
            self._read_file(file_name, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, file_name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        from safetensors import safe_open

        others = []
        with open(file_name, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            header = orjson.loads(f.read(header_bytes))
            for item in items:
                stored = self.storage_data[item.storage_index]
                shape = tuple(stored.shape)
                if not shape or any(offset != 0 or length != size for offset, length, size
                                    in zip(item.storage_offsets[1:], item.lengths[1:], shape[1:], strict=True)):
                    others.append(item)
                    continue
                row_bytes = stored.dtype.itemsize * torch.Size(shape[1:]).numel()
                start = 8 + header_bytes + header[item.storage_index.fqn]["data_offsets"][0] \
                    + item.storage_offsets[0] * row_bytes
                target = planner.resolve_tensor(item).detach()
                direct = target.dtype == stored.dtype and target.is_contiguous() and target.device.type == "cpu"
                into = target if direct else torch.empty(tuple(item.lengths), dtype=stored.dtype)
                _pread_exactly(f.fileno(), into, start, file_name)
                if not direct:
                    target.copy_(into)
                planner.commit_tensor(item, target)
        if others:
            with safe_open(filename=file_name, framework="pt") as f:
                for item in others:
                    self._process_read_request(f, item, planner)


def _pread_exactly(fd: int, into: torch.Tensor, start: int, file_name: str) -> None:
    """Fill ``into``'s bytes from ``fd`` at ``start``."""
    view = memoryview(into.view(torch.uint8).numpy()).cast("B")
    got = 0
    while got < len(view):
        read = os.preadv(fd, [view[got:]], start + got)
        if read == 0:
            raise ConfigError("model.name", f"{file_name} ends before the {len(view)} bytes at {start} its "
                                            "header names: a truncated safetensors file")
        got += read


def fill_shards(model: nn.Module, policy: Policy, device: torch.device, model_dtype: torch.dtype) -> None:
    """Give a model built empty (``policy.build_empty_model``) and sharded its weights, each rank allocating its own
    shards only; every rank must call it.

    A Hugging Face model: every rank reads its own slices of the safetensors files (DCP's
    ``HuggingFaceStorageReader``), so no process holds more than its shards and one tensor's slice in transit, and
    the ranks read in parallel.  The weights pass through ``model_dtype`` as ``from_pretrained`` casts them at
    world size 1.  The tiny model has no files: rank 0 builds it from its seed and broadcasts it a tensor at a time.
    """
    import torch.distributed as dist

    model.to_empty(device=device)
    policy.reset_buffers(model)  # first: it may initialise a module's parameters too, which the weights replace
    if policy.model_dir is None:
        whole = policy.build_model().state_dict() if dist.get_rank() == 0 else {}
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    import torch.distributed.checkpoint as dcp

    reader = SliceReader(str(policy.model_dir))
    stored = reader.read_metadata().state_dict_metadata
    # The parameters themselves (``keep_vars``): a tied one is one tensor, stored under its first name only.
    own: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            own[name] = tensor.detach()
    if missing := sorted(set(own) - set(stored)):
        raise ConfigError("model.name", f"{policy.model_dir}: its safetensors files lack {', '.join(missing[:5])}"
                                        f"{' ...' if len(missing) > 5 else ''} (stored under other names?); a "
                                        "sharded trainer reads the weights under the model's own names: train "
                                        "it at trainer.world_size = 1")
    dcp.load(own, storage_reader=reader)
    with torch.no_grad():
        for tensor in own.values():
            if tensor.is_floating_point() and tensor.dtype != model_dtype:
                tensor.copy_(tensor.to(model_dtype))


def _parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's tensor whole: gathered from every rank's shard (a collective) if it is sharded."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on rank 0 (host memory), an empty dict elsewhere; every rank must call it.  A tied
    tensor (an embedding that is also the output head) is gathered once and stays one tensor under both
    names: saved once, loaded back into the one parameter."""
    import torch.distributed as dist

    keep = dist.get_rank() == 0
    first_name: dict[int, str] = {}
    weights: dict[str, torch.Tensor] = {}
    # The parameters themselves (``keep_vars``): a tied one is one object under both names.
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:
            if keep:
                weights[name] = weights[first_name[id(tensor)]]
            continue
        first_name[id(tensor)] = name
        whole = _whole(tensor)  # every rank, in the same order
        if keep:
            weights[name] = whole.to("cpu", copy=True)
    return weights


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole state on rank 0 (host memory), empty dicts elsewhere; every rank must call it."""
    weights = full_weights(model)
    by_name = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not weights:
        return {}, {}
    from torch.distributed.tensor import DTensor

    # Gathered shards are new tensors; an unsharded state tensor (AdamW's ``step``) comes back as the
    # live one, which the next step increments in place under a checkpoint still being written.
    live = dict(model.named_parameters())
    for name, state in by_name["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(optimizer.state[live[name]][key], DTensor):
                state[key] = value.clone()
    index = {name: i for i, name in enumerate(_parameter_names(model))}
    return weights, {
        "state": {index[name]: state for name, state in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in by_name["param_groups"]],
    }


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    weights: dict[str, torch.Tensor], by_index: dict[str, Any]) -> None:
    """Load a whole state (``full_state``'s form) into this rank's shards; every rank must call it."""
    names = _parameter_names(model)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, {
        "state": {names[i]: state for i, state in by_index["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in by_index["param_groups"]],
    }, options=options)


def gathered(model: nn.Module, names: list[str], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    """The whole tensors of ``names`` (host memory), floating ones in ``dtype``, and the bytes their all-gathers
    produced; every rank must call it with the same names.

    Each rank casts its own shard to ``dtype`` where it lives, before the gather: the all-gather moves ``dtype``'s
    bytes (half fp32's for bf16) and no process holds a whole fp32 copy.  A cast is elementwise, so a shard cast
    rounds each weight exactly as casting the whole tensor does (world size 1's ``live_weights``).
    """
    from torch.distributed.tensor import DTensor

    own = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    moved = 0
    for name in names:
        tensor = own[name].detach()
        cast = tensor.to(dtype) if tensor.is_floating_point() else tensor
        whole = _whole(cast)
        if isinstance(cast, DTensor):
            moved += whole.numel() * whole.element_size()
        tensors[name] = whole.to("cpu")
    return tensors, moved
