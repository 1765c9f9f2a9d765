"""A sharded trainer's ranks load the model without a whole copy each (real gloo ranks, spawned, on loopback): built
on the meta device, sharded, then filled, the state gathered from two ranks is bitwise world size 1's plain load,
tied weights tied and the buffers no checkpoint holds (RoPE's ``inv_freq``) computed; a rank's memory rises by
its share of the model, not by the model."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bench.trainer_memory import write_tied_llama
from bench.trainer_state import PeakRss, rss_bytes
from scd.model.policy import build_policy
from scd.training.grpo import GRPOTrainer
from scd.training.sharding import fill_shards, full_weights, shard_model
from tests.conftest import tiny_config
from tests.test_dcp_state import run_ranks
from tests.test_mixed_precision import tied_llama


def config_for(work: Path, model: str, dtype: str) -> object:
    return tiny_config(work, "unused", model={"name": model, "dtype": dtype})


def loaded_state(trainer: GRPOTrainer) -> dict[str, dict[str, torch.Tensor]]:
    """The weights whole (rank 0's; a tied tensor one object under both names) and every buffer."""
    return {"weights": full_weights(trainer.model) if trainer.sharded else dict(trainer.model.state_dict()),
            "buffers": {name: buffer.detach().clone() for name, buffer in trainer.model.named_buffers()}}


def load_sharded(model: str, dtype: str, work: Path) -> None:
    """One rank: a sharded trainer's load; rank 0 writes what the ranks hold, whole, to work/sharded.pt."""
    config = config_for(work, model, dtype)
    trainer = GRPOTrainer(config, build_policy(config.model, config.run.seed), sharded=True)
    world = dist.get_world_size()
    # Each rank holds its own shards only (FSDP2 splits the leading dim), and a tied head stays the embedding's
    # one parameter.
    for name, parameter in trainer.model.named_parameters():
        assert isinstance(parameter, DTensor), name
        rows = -(-parameter.shape[0] // world)
        assert parameter.to_local().numel() <= rows * (parameter.numel() // parameter.shape[0]), name
    inner = getattr(trainer.model, "model", None)
    if inner is not None and config.model.name != "tiny":
        assert trainer.model.lm_head.weight is inner.embed_tokens.weight
    state = loaded_state(trainer)
    if dist.get_rank() == 0:
        torch.save(state, work / "sharded.pt")


def assert_bitwise(plain: dict[str, torch.Tensor], sharded: dict[str, torch.Tensor]) -> None:
    assert list(sharded) == list(plain)
    for name, tensor in plain.items():
        assert sharded[name].dtype == tensor.dtype and torch.equal(sharded[name], tensor), name


@pytest.mark.slow  # spawns gloo ranks
@pytest.mark.parametrize("kind", ["embedded", "tied_llama_bf16", "tied_llama_bf16_files"])
def test_two_ranks_built_on_meta_and_filled_hold_world_size_1s_plain_load_bitwise(tmp_path: Path, kind: str) -> None:
    if kind == "embedded":
        model, dtype = "tiny", "float32"
    else:
        # bf16 over fp32 masters: the weights pass through the model's dtype as ``from_pretrained`` casts them,
        # from fp32 files (read into the shards themselves) or bf16 ones (through a buffer: the dtypes differ).
        model, dtype = str(tied_llama(tmp_path / "tied-llama")), "bfloat16"
        if kind == "tied_llama_bf16_files":
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(model)
    run_ranks(2, functools.partial(load_sharded, model, dtype), tmp_path)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)

    config = config_for(tmp_path, model, dtype)
    plain = loaded_state(GRPOTrainer(config, build_policy(config.model, config.run.seed)))
    assert_bitwise(plain["weights"], sharded["weights"])
    assert_bitwise(plain["buffers"], sharded["buffers"])
    if kind != "embedded":
        assert any(name.endswith("inv_freq") for name in plain["buffers"])
        assert sharded["weights"]["lm_head.weight"] is sharded["weights"]["model.embed_tokens.weight"]


def load_share(model: str, work: Path) -> None:
    """One rank: the sharded load alone (built empty, sharded, filled), its RSS rise and share to work/rank-R.pt."""
    config = config_for(work, model, "float32")
    policy = build_policy(config.model, config.run.seed)
    policy.build_empty_model()  # what it imports, outside the measurement
    before = rss_bytes()
    with PeakRss() as peak:
        built = policy.build_empty_model().to(torch.float32)
        shard_model(built, policy, config.trainer, torch.float32, torch.float32)
        fill_shards(built, policy, torch.device("cpu"), torch.float32)
    sizes = [p.numel() * p.element_size() for p in built.parameters()]
    torch.save({"rise": peak.peak - before, "model": sum(sizes), "largest": max(sizes)},
               work / f"rank-{dist.get_rank()}.pt")


@pytest.mark.slow  # spawns gloo ranks
def test_a_ranks_memory_rises_by_its_share_of_the_model_while_it_loads(tmp_path: Path) -> None:
    """At ~23M parameters (92 MB of fp32, its largest tensor 8 MB), each of two ranks adds at most 1.5 times its
    half, plus one tensor: a whole copy per rank (the model's bytes) would not fit under it."""
    model = write_tied_llama(tmp_path / "llama", vocab_size=4096, hidden_size=512, layers=8, heads=8)
    run_ranks(2, functools.partial(load_share, str(model)), tmp_path)
    for rank in range(2):
        measured = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        bound = 1.5 * measured["model"] / 2 + measured["largest"]
        assert bound < measured["model"]
        assert measured["rise"] <= bound, (rank, measured)


def test_files_that_name_a_weight_otherwise_are_refused_naming_it_before_anything_is_read(tmp_path: Path) -> None:
    """A checkpoint whose keys are not the model's own names (an older layout ``from_pretrained`` converts) cannot
    be read a slice at a time: exit 2, the key named, rather than a rank training on uninitialised memory."""
    from safetensors.torch import load_file, save_file

    from scd.errors import ConfigError

    model = tied_llama(tmp_path / "tied-llama")
    weights = load_file(model / "model.safetensors")
    weights["model.norm.gamma"] = weights.pop("model.norm.weight")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    policy = build_policy(config_for(tmp_path, str(model), "float32").model, 0)
    with pytest.raises(ConfigError) as refused:
        fill_shards(policy.build_empty_model(), policy, torch.device("cpu"), torch.float32)
    assert refused.value.exit_code == 2 and "model.norm.weight" in str(refused.value)
