"""FSDP2 inside one trainer rank: sharding the model, and its state gathered or loaded whole.

A rank's process group is the default one (``TrainerGroup`` sets it up).  A bundle holds the whole,
unsharded state, with the optimizer's keyed by parameter index as a plain ``optimizer.state_dict()``
is, so one bundle restores at any world size, in scd's process or on ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from scd.config import TrainerConfig
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


def gathered(model: nn.Module, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The whole tensors of ``names`` (host memory), floating ones in ``dtype``; every rank must call it with
    the same names."""
    own = model.state_dict()
    whole = {name: _whole(own[name]) for name in names}
    return {name: t.to("cpu", dtype if t.is_floating_point() else t.dtype) for name, t in whole.items()}
