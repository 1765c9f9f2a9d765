"""The trainer at world size 1 on real torch: fp32 master weights under a bf16 model, and logprobs computed
a chunk of tokens at a time with the plain computation's numbers and gradients."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.trainer_memory import bundle_bytes_ratio, write_tied_llama
from scd.config import parse_config
from scd.model.policy import build_policy, state_copy
from scd.model.sampling import Sampling
from scd.model.weights import storage_key, unaliased
from scd.records import Rollout
from scd.training.grpo import CopiedState, GRPOTrainer, HostBuffers
from scd.training.logprobs import full_token_logprobs, token_logprobs


@pytest.mark.parametrize("sampling", [Sampling(1.0, 0, 1.0), Sampling(0.7, 5, 1.0), Sampling(1.3, 0, 0.8),
                                      Sampling(1.0, 7, 0.9)], ids=["plain", "top_k", "top_p", "both"])
def test_chunked_logprobs_are_the_full_computation_values_and_gradients(sampling: Sampling) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    hidden = torch.randn(300, 16, requires_grad=True)
    with torch.no_grad():  # targets the truncated distribution keeps, as generation would have drawn
        targets = torch.distributions.Categorical(logits=sampling.logits(head(hidden))).sample()
    weights = torch.randn(300)

    def backward(chosen: torch.Tensor, entropy: torch.Tensor) -> list[torch.Tensor]:
        ((chosen * weights).sum() + entropy.sum()).backward()
        grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
        hidden.grad = head.weight.grad = head.bias.grad = None
        return grads

    full = full_token_logprobs(hidden, targets, head, sampling)
    full_grads = backward(*full)
    chunked = token_logprobs(hidden, targets, head, sampling, chunk_tokens=64, entropy_in_loss=True)
    chunked_grads = backward(*chunked)
    for ours, reference in zip((*chunked, *chunked_grads), (*full, *full_grads), strict=True):
        assert torch.isfinite(ours).all()
        assert torch.allclose(ours, reference, atol=1e-5, rtol=0), (ours - reference).abs().max()


def rows_for(trainer: GRPOTrainer, seed: int, groups: int = 2, size: int = 4, prompt: int = 6,
             completion: int = 10) -> list[list[Rollout]]:
    """Random rows with rewards that differ within each group, their behaviour logprobs the trainer's own."""
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.head.weight.shape[0]
    made = []
    for _ in range(groups):
        group = []
        for index in range(size):
            ids = torch.randint(4, vocab, (prompt + completion,), generator=generator)
            with torch.no_grad(), trainer.computing():
                hidden = trainer.policy.hidden(trainer.model, ids[None])[0, prompt - 1:-1]
                logprobs, _ = full_token_logprobs(hidden, ids[prompt:], trainer.head, trainer.sampling)
            group.append(Rollout(ids, logprobs.float(), prompt, reward=float(index % 2), weight_version=0))
        made.append(group)
    return made


def trainer_for(tiny_llama: Path, tmp_path: Path, **trainer: object) -> GRPOTrainer:
    dtype = trainer.pop("dtype", "float32")
    config = parse_config({"run": {"output_dir": str(tmp_path)}, "model": {"name": str(tiny_llama), "dtype": dtype},
                           "trainer": trainer}, tmp_path)
    return GRPOTrainer(config, build_policy(config.model, 0))


def test_bf16_with_fp32_masters_moves_every_parameter_at_lr_1e_6(tiny_llama: Path, tmp_path: Path) -> None:
    trainer = trainer_for(tiny_llama, tmp_path, dtype="bfloat16", lr=1e-6)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert {t.dtype for t in trainer.live_weights().values()} == {torch.bfloat16}  # what generation gets
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.step(rows_for(trainer, 0), weight_version=0)
    still = [name for name, p in trainer.model.named_parameters() if torch.equal(p, before[name])]
    assert not still, f"unchanged after a step at lr 1e-6: {still}"
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())

    # Pure bf16 (master_dtype = "model"), today's behaviour on request: the norms' 1.0 cannot move by 1e-6.
    pure = trainer_for(tiny_llama, tmp_path, dtype="bfloat16", lr=1e-6, master_dtype="model")
    before = {name: p.detach().clone() for name, p in pure.model.named_parameters()}
    pure.step(rows_for(pure, 0), weight_version=0)
    unchanged = [name for name, p in pure.model.named_parameters() if torch.equal(p, before[name])]
    assert any("norm" in name for name in unchanged)


# Over 20 steps at lr 1e-3, how far the bf16-computed masters may drift from an fp32 run, relative to how far
# the fp32 run moved from the initial weights (measured: about 0.02).
TRACKING_TOLERANCE = 0.1


def test_bf16_masters_track_an_fp32_run(tiny_llama: Path, tmp_path: Path) -> None:
    reference = trainer_for(tiny_llama, tmp_path, lr=1e-3)
    mixed = trainer_for(tiny_llama, tmp_path, dtype="bfloat16", lr=1e-3)
    initial = {name: p.detach().clone() for name, p in reference.model.named_parameters()}
    for step in range(20):
        reference.step(rows_for(reference, step), weight_version=step)
        mixed.step(rows_for(mixed, step), weight_version=step)
    moved = drift = 0.0
    for (name, p), q in zip(reference.model.named_parameters(), mixed.model.parameters(), strict=True):
        moved += float((p.detach() - initial[name]).pow(2).sum())
        drift += float((p.detach() - q.detach()).pow(2).sum())
    ratio = (drift / moved) ** 0.5
    print(f"bf16 masters vs fp32 after 20 steps: drift / moved = {ratio:.4f}")
    assert moved > 0 and ratio < TRACKING_TOLERANCE


def test_activation_checkpointing_and_chunks_change_no_number(tiny_llama: Path, tmp_path: Path) -> None:
    plain = trainer_for(tiny_llama, tmp_path, lr=1e-3)
    lean = trainer_for(tiny_llama, tmp_path, lr=1e-3, activation_checkpointing=True, logprob_chunk_tokens=7)
    rows = rows_for(plain, 0)
    grads = {plain: [], lean: []}
    for trainer in grads:  # the step frees the gradients once the optimizer has used them
        trainer.optimizer.register_step_pre_hook(
            lambda *_, trainer=trainer: grads[trainer].extend(p.grad.clone() for p in trainer.model.parameters()))
    first, second = plain.step(rows, weight_version=0), lean.step(rows, weight_version=0)
    assert first.loss == pytest.approx(second.loss, abs=1e-6) and first.entropy == pytest.approx(second.entropy)
    # The gradients, not the weights: Adam's first step moves a weight by about lr whatever its gradient's size,
    # so summation-order noise on a near-zero gradient would show as a full step.
    assert len(grads[plain]) == len(grads[lean]) == len(list(plain.model.parameters()))
    for p, q in zip(grads[plain], grads[lean], strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-4)


def tied_llama(directory: Path) -> Path:
    """A small random HF Llama whose output head is its embedding (as Qwen2.5-0.5B's)."""
    return write_tied_llama(directory, vocab_size=2048, hidden_size=64, layers=2, heads=2)


def test_a_tied_embedding_is_cast_and_synced_once_and_the_bundle_holds_unique_bytes(tmp_path: Path) -> None:
    """bf16 over fp32 masters at world size 1: the model-dtype copy a weight sync sends casts the tied
    embedding once, so the sync (``unaliased``, as the transfer and the reload read it) sends each storage
    once, while every name the receiver looks up is there."""
    trainer = trainer_for(tied_llama(tmp_path / "model"), tmp_path, dtype="bfloat16")
    trainer.step(rows_for(trainer, 0), weight_version=0)
    live = trainer.live_weights()
    assert list(live) == list(trainer.model.state_dict())
    assert live["lm_head.weight"] is live["model.embed_tokens.weight"]
    unique = {storage_key(t) for t in trainer.model.state_dict().values()}
    assert len(unaliased(live)) == len(unique) == len(live) - 1
    assert bundle_bytes_ratio(trainer, tmp_path) <= 1.02


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_a_step_frees_its_gradients_and_a_dropped_trainer_is_freed_at_once(tmp_path: Path,
                                                                              checkpointing: bool) -> None:
    """Gradients are not held past the step (a weight sync's model-dtype copy and a capture come between two
    steps), and nothing keeps a trainer alive in a reference cycle: the last reference gone, its model and
    optimizer state are freed then, not at a garbage collection that may come after the next trainer is built
    (bench/gpu_trainer.py's ``largest_fit`` builds one per size it tries)."""
    import gc
    import weakref

    model = tied_llama(tmp_path / "model")
    trainer = trainer_for(model, tmp_path, dtype="bfloat16", activation_checkpointing=checkpointing)
    trainer.step(rows_for(trainer, 0), weight_version=0)
    assert trainer.optimizer.state and all(p.grad is None for p in trainer.model.parameters())
    trainer.live_weights()
    trainer.capture_state()
    alive = [weakref.ref(trainer), weakref.ref(trainer.model), weakref.ref(trainer.head.weight)]
    gc.disable()
    try:
        del trainer
        assert [ref() is None for ref in alive] == [True] * len(alive)
    finally:
        gc.enable()


def test_a_tied_embedding_is_copied_and_saved_once_and_restored_tied(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    def tied() -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))

    model = tied()
    copied = state_copy(model)
    assert copied["lm_head.weight"] is copied["model.embed_tokens.weight"]
    torch.save(copied, tmp_path / "model.pt")
    unique = sum(t.numel() * t.element_size() for t in {id(t): t for t in copied.values()}.values())
    assert (tmp_path / "model.pt").stat().st_size <= 1.02 * unique
    restored = tied()
    restored.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert restored.lm_head.weight is restored.model.embed_tokens.weight
    assert torch.equal(restored.lm_head.weight, model.lm_head.weight)


def test_a_pure_bf16_state_restores_as_fp32_masters(tiny_llama: Path, tmp_path: Path) -> None:
    """A bundle written before masters existed (bf16 weights and AdamW state) loads into a trainer with them."""
    old = trainer_for(tiny_llama, tmp_path, dtype="bfloat16", lr=1e-3, master_dtype="model")
    old.step(rows_for(old, 0), weight_version=0)
    old.capture_state().write(tmp_path / "model.pt", tmp_path / "optimizer.pt")
    new = trainer_for(tiny_llama, tmp_path, dtype="bfloat16", lr=1e-3)
    new.load_state_files(tmp_path / "model.pt", tmp_path / "optimizer.pt")
    for p, q in zip(old.model.parameters(), new.model.parameters(), strict=True):
        assert q.dtype == torch.float32 and torch.equal(p.float(), q)
    assert all(s["exp_avg"].dtype == torch.float32 for s in new.optimizer.state.values())
    new.step(rows_for(new, 1), weight_version=1)  # and trains on


@pytest.mark.slow  # a subprocess
def test_the_gpu_bench_runs_its_tiny_shape_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_trainer.py, which a GPU host runs with torch alone: its every section, on the CPU."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    subprocess.run([sys.executable, str(REPO / "bench" / "gpu_trainer.py"), "--tiny", "--out", str(tmp_path)],
                   cwd=tmp_path, check=True, timeout=300, capture_output=True)
    tiny = json.loads((tmp_path / "gpu_trainer.json").read_text())["tiny"]
    assert tiny["groups_fit"] >= 1 and tiny["step_s"] > 0 and tiny["tokens_per_s"] > 0
    assert min(tiny["moved_at_lr_1e-6"].values()) > 0.99  # fp32 masters: a step at lr 1e-6 moves nearly all
    assert tiny["state"]["bytes"] > 0 and tiny["state"]["restore_s"] > 0


def test_host_buffers_are_reused_by_the_next_capture_but_never_while_one_is_being_written(tmp_path: Path) -> None:
    """The reuse logic of the CUDA capture's pinned host buffers (its copies on a side stream are unverified
    here: no GPU), with plain host tensors in place of pinned ones."""
    pool = HostBuffers(lambda like: torch.empty(like.shape, dtype=like.dtype))
    embedding = torch.randn(4, 3)
    live = {"embed": embedding, "head": embedding, "norm": torch.ones(3), "step": 7}
    lent = pool.lend()
    first = pool.copy(lent, "model", live)
    assert first["embed"] is first["head"] and first["step"] == 7  # a tied tensor: one buffer, both names
    assert torch.equal(first["embed"], embedding) and first["embed"].data_ptr() != embedding.data_ptr()

    # A capture while the first is still being written gets buffers of its own.
    overlapping = pool.copy(pool.lend(), "model", live)
    assert overlapping["embed"].data_ptr() != first["embed"].data_ptr()

    # Written, the first capture's buffers go back, and the next capture copies into them.
    CopiedState(first, {}, functools.partial(pool.give_back, lent)).write(tmp_path / "m.pt", tmp_path / "o.pt")
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["head"], embedding)
    embedding.add_(1.0)
    again = pool.copy(pool.lend(), "model", live | {"norm": torch.ones(5)})
    assert again["embed"].data_ptr() == first["embed"].data_ptr() and torch.equal(again["embed"], embedding)
    assert again["norm"].shape == (5,)  # a tensor whose shape changed gets a new buffer


def test_host_buffers_go_back_once_when_a_write_fails_or_the_capture_is_discarded(tmp_path: Path) -> None:
    """A failed write (a full disk) or a capture the checkpointer discards unwritten still gives its buffers
    back, and only once: otherwise each later capture pins a new set the size of model and optimizer, or two
    captures share one."""
    pool = HostBuffers(lambda like: torch.empty(like.shape, dtype=like.dtype))
    live = {"embed": torch.randn(4, 3)}
    lent = pool.lend()
    failing = CopiedState(pool.copy(lent, "model", live), {}, functools.partial(pool.give_back, lent))
    with pytest.raises(FileNotFoundError):
        failing.write(tmp_path / "missing" / "m.pt", tmp_path / "missing" / "o.pt")
    assert pool.lend() is lent
    failing.release()  # the checkpointer releases every capture when its bundle is done: no second give-back
    assert pool.lend() == {}

    discarded = CopiedState(pool.copy(lent, "model", live), {}, functools.partial(pool.give_back, lent))
    discarded.release()
    discarded.release()
    assert pool.lend() is lent and pool.lend() == {}
