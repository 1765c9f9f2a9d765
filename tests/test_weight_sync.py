"""A weight sync at world size 2 (two FSDP2 ranks on the session's real Ray, gloo): each rank casts its shards to
``model.dtype`` before the all-gather, so the gathers move the model dtype's bytes of each tensor once, and the
engines get bit for bit what world size 1 sends for the same fp32 masters."""

from __future__ import annotations

from pathlib import Path

import anyio
import torch

from scd.model.policy import build_policy
from scd.model.weights import unaliased
from scd.training.group import TrainerGroup
from scd.training.grpo import GRPOTrainer
from tests.conftest import tiny_config
from tests.test_mixed_precision import tied_llama
from tests.test_trainer_group import GROUPS, batch


async def test_a_bf16_sync_at_world_size_2_gathers_bf16_once_and_sends_world_size_1s_bits(
        tmp_path: Path, tq_session: None) -> None:
    model = tied_llama(tmp_path / "tied-llama")
    trainer = {"groups_per_step": GROUPS, "lr": 1e-3}
    shape = {"model": {"name": str(model), "dtype": "bfloat16"}}
    two_config = tiny_config(tmp_path, "unused", trainer={**trainer, "world_size": 2},
                             data_plane={"ray": {"num_cpus": 5}}, **shape)
    one_config = tiny_config(tmp_path, "unused", trainer=trainer, **shape)
    state = tmp_path / "state"
    state.mkdir()
    async with TrainerGroup.open(two_config) as two:
        await anyio.to_thread.run_sync(two.step, batch(0), 1)
        capture = two.capture_state()
        await anyio.to_thread.run_sync(capture.write, state / "model.pt", state / "optimizer.pt")
        exported = two.live_weights()
        synced = await anyio.to_thread.run_sync(lambda: {name: exported[name].clone() for name in exported})
        moved = exported.gathered_bytes

    # World size 1 on the same fp32 masters: after a step they are off bf16's grid, so the cast rounds them.
    one = GRPOTrainer(one_config, build_policy(one_config.model, one_config.run.seed))
    one.load_state_files(state / "model.pt", state / "optimizer.pt")
    masters = list(one.model.parameters())
    assert {p.dtype for p in masters} == {torch.float32}
    assert any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in masters)
    sent = unaliased(one.live_weights())
    assert list(synced) == list(sent) and "lm_head.weight" not in synced  # the tied head: sent once
    for name, tensor in sent.items():
        assert synced[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(synced[name], tensor), name

    # The gathers (counted where they happen, on rank 0) moved each unique parameter once in bf16: half the fp32
    # masters' bytes.
    unique_bf16 = sum(p.numel() * torch.bfloat16.itemsize for p in masters)
    assert moved == unique_bf16 == sum(p.numel() * p.element_size() for p in masters) // 2
