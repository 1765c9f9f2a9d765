"""The trainer's state as a DCP checkpoint (``scd.training.dcp_state``) on real gloo ranks (spawned processes that
meet at a TCPStore on loopback): saved at world size 2, loaded at 1, saved again and loaded at 2, the weights and
AdamW state come back exactly and training continues as an uninterrupted run does; a torn, missing or foreign file
is refused naming it; each recorded digest is the file's; a tied weight is stored once."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import blake3
import msgspec
import orjson
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from scd.training.dcp_state import (
    METADATA_FILE,
    TrainerStateManifest,
    TrainerStateRefused,
    capture_trainer_state,
    export_safetensors,
    load_trainer_state,
    save_trainer_state,
    write_trainer_state,
)

VOCAB, ROWS, TOKENS = 2048, 4, 16
STEPS_BEFORE_SAVE, STEPS_AFTER = 3, 2
RANK_TIMEOUT_S = 300


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny HF Llama whose output head is its embedding (the embedding is most of its bytes), and AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator)
            for _ in range(STEPS_BEFORE_SAVE + STEPS_AFTER)]


def step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One AdamW step on this rank's rows; the loss of the whole batch (equal rows per rank: FSDP's mean of the
    ranks' gradients is the whole batch's)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rows = tokens[rank::world]
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total) / world


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Weights and optimizer state, whole and keyed by parameter name (every rank calls it; rank 0 gets it)."""
    weights, state = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True))
    return {"model": weights, "optimizer": state}


def save_whole_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """``whole_state`` to ``path`` from rank 0, now: AdamW's ``step`` comes back as the live tensor, which the
    next step increments in place."""
    state = whole_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(state, path)


def assert_states_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for part in ("model", "optimizer"):
        assert got[part].keys() == want[part].keys()
        for key, value in want[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[part][key], value), key
            else:
                assert got[part][key] == value, key


def write_json(path: Path, value: Any) -> None:
    path.write_bytes(orjson.dumps(value))


def read_manifest(path: Path) -> TrainerStateManifest:
    return msgspec.json.decode(path.read_bytes(), type=TrainerStateManifest)


# ---- what each rank of a spawned group runs ------------------------------------------------------------------


def train_and_save(work: Path) -> None:
    """Train, save at this world size into work/first, then keep training: the uninterrupted run."""
    model, optimizer = build()
    data = batches()
    for tokens in data[:STEPS_BEFORE_SAVE]:
        step(model, optimizer, tokens)
    manifest = save_trainer_state(model, optimizer, work / "first")
    save_whole_state(model, optimizer, work / "first.state.pt")
    losses = [step(model, optimizer, tokens) for tokens in data[STEPS_BEFORE_SAVE:]]
    if dist.get_rank() == 0:
        (work / "first.manifest.json").write_bytes(msgspec.json.encode(manifest))
        write_json(work / "uninterrupted.json", losses)


def refuse_torn_then_load_and_continue(work: Path) -> None:
    """Refuse a torn copy of work/second (every rank, naming the file), then load work/second and keep training."""
    manifest = read_manifest(work / "second.manifest.json")
    model, optimizer = build()
    try:
        load_trainer_state(model, optimizer, work / "torn", manifest)
        raise AssertionError("a torn shard was loaded")
    except TrainerStateRefused as refused:
        write_json(work / f"refused.{dist.get_rank()}.json", str(refused))
    load_trainer_state(model, optimizer, work / "second", manifest)
    save_whole_state(model, optimizer, work / "second.state.pt")
    losses = [step(model, optimizer, tokens) for tokens in batches()[STEPS_BEFORE_SAVE:]]
    if dist.get_rank() == 0:
        write_json(work / "resumed.json", losses)


def capture_then_write_beside_a_step(work: Path) -> None:
    """Capture at a step boundary, then write the capture on a thread over a process group of its own while the
    next step runs its collectives on the default group."""
    writer_group = dist.new_group(backend="gloo")
    model, optimizer = build()
    data = batches()
    for tokens in data[:STEPS_BEFORE_SAVE]:
        step(model, optimizer, tokens)
    save_whole_state(model, optimizer, work / "captured.state.pt")
    captured = capture_trainer_state(model, optimizer)
    manifests: list[TrainerStateManifest] = []
    writer = threading.Thread(target=lambda: manifests.append(
        write_trainer_state(captured, work / "beside", process_group=writer_group)))
    writer.start()
    for tokens in data[STEPS_BEFORE_SAVE:]:
        step(model, optimizer, tokens)
    writer.join(RANK_TIMEOUT_S)
    if dist.get_rank() == 0:
        (work / "beside.manifest.json").write_bytes(msgspec.json.encode(manifests[0]))


def rank_main(rank: int, world: int, port: int, job: Callable[[Path], None], work: Path) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        job(work)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, job: Callable[[Path], None], work: Path) -> None:
    """``job(work)`` on ``world`` spawned gloo ranks; fails naming each rank that did not exit 0."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RANK_TIMEOUT_S))
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, world, store.port, job, work)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(RANK_TIMEOUT_S)
    failed = [(rank, process.exitcode) for rank, process in enumerate(ranks) if process.exitcode != 0]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert not failed, f"ranks (rank, exit code) failed: {failed}"


# ---- tests ----------------------------------------------------------------------------------------------------


def shard_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name != METADATA_FILE)


def assert_manifest_is_the_disk(directory: Path, manifest: TrainerStateManifest) -> None:
    assert set(manifest.files) == {p.name for p in directory.iterdir()}
    for name, recorded in manifest.files.items():
        path = directory / name
        assert recorded.size == path.stat().st_size, name
        assert recorded.blake3 == blake3.blake3(path.read_bytes()).hexdigest(), name


@pytest.mark.slow  # spawns gloo ranks
def test_state_saved_at_two_loads_at_one_and_back_at_two_and_trains_on_as_uninterrupted(tmp_path: Path) -> None:
    run_ranks(2, train_and_save, tmp_path)
    first = read_manifest(tmp_path / "first.manifest.json")
    assert first.world_size == 2
    assert sorted(first.files) == [METADATA_FILE, "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own
    assert_manifest_is_the_disk(tmp_path / "first", first)
    saved = torch.load(tmp_path / "first.state.pt", weights_only=True)
    uninterrupted = orjson.loads((tmp_path / "uninterrupted.json").read_bytes())

    # World size 1: no process group.  A fresh optimizer with another lr gets the saved one back.
    model, optimizer = build()
    optimizer.param_groups[0]["lr"] = 0.5
    load_trainer_state(model, optimizer, tmp_path / "first", first)
    assert_states_equal(whole_state(model, optimizer), saved)
    assert optimizer.param_groups[0]["lr"] == 1e-3
    second = save_trainer_state(model, optimizer, tmp_path / "second")
    assert second.world_size == 1
    assert_manifest_is_the_disk(tmp_path / "second", second)
    (tmp_path / "second.manifest.json").write_bytes(msgspec.json.encode(second))
    continued = [step(model, optimizer, tokens) for tokens in batches()[STEPS_BEFORE_SAVE:]]
    assert continued == pytest.approx(uninterrupted, rel=1e-5)

    shutil.copytree(tmp_path / "second", tmp_path / "torn")
    torn = tmp_path / "torn" / "__0_0.distcp"
    os.truncate(torn, torn.stat().st_size // 2)
    run_ranks(2, refuse_torn_then_load_and_continue, tmp_path)
    for rank in range(2):
        refusal = orjson.loads((tmp_path / f"refused.{rank}.json").read_bytes())
        assert "__0_0.distcp" in refusal and "torn" in refusal
    assert_states_equal(torch.load(tmp_path / "second.state.pt", weights_only=True), saved)
    resumed = orjson.loads((tmp_path / "resumed.json").read_bytes())
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.slow  # spawns gloo ranks
def test_an_export_of_a_world_size_2_checkpoint_loads_in_transformers_with_its_weights(tmp_path: Path) -> None:
    """Files of at most a third of the weights' bytes: several, and an index; the tied head in them once."""
    from transformers import LlamaForCausalLM

    run_ranks(2, train_and_save, tmp_path)
    manifest = read_manifest(tmp_path / "first.manifest.json")
    saved = torch.load(tmp_path / "first.state.pt", weights_only=True)["model"]
    model, _ = build()
    out = tmp_path / "export"
    out.mkdir()
    model.config.save_pretrained(out)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    files = export_safetensors(tmp_path / "first", manifest, out, torch.bfloat16, max_file_bytes=unique // 3)
    assert len(files) > 2 and "model.safetensors.index.json" in files
    index = orjson.loads((out / "model.safetensors.index.json").read_bytes())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert index["metadata"]["total_size"] == unique // 2  # bf16
    exported = LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name


@pytest.mark.slow  # spawns gloo ranks
def test_a_capture_written_beside_the_next_steps_holds_the_boundarys_state(tmp_path: Path) -> None:
    run_ranks(2, capture_then_write_beside_a_step, tmp_path)
    manifest = read_manifest(tmp_path / "beside.manifest.json")
    assert_manifest_is_the_disk(tmp_path / "beside", manifest)
    model, optimizer = build()
    load_trainer_state(model, optimizer, tmp_path / "beside", manifest)
    assert_states_equal(whole_state(model, optimizer), torch.load(tmp_path / "captured.state.pt", weights_only=True))


def test_a_capture_is_a_copy_the_next_step_leaves_alone(tmp_path: Path) -> None:
    model, optimizer = build()
    step(model, optimizer, batches()[0])
    boundary = {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
                for part, values in whole_state(model, optimizer).items()}
    captured = capture_trainer_state(model, optimizer)
    step(model, optimizer, batches()[1])
    manifest = write_trainer_state(captured, tmp_path / "state")
    fresh, fresh_optimizer = build()
    load_trainer_state(fresh, fresh_optimizer, tmp_path / "state", manifest)
    assert_states_equal(whole_state(fresh, fresh_optimizer), boundary)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, Path, TrainerStateManifest]:
    """A model and optimizer two steps in, saved at world size 1 into tmp_path/state."""
    model, optimizer = build()
    for tokens in batches()[:2]:
        step(model, optimizer, tokens)
    return model, optimizer, tmp_path / "state", save_trainer_state(model, optimizer, tmp_path / "state")


def refusal(directory: Path, manifest: TrainerStateManifest) -> str:
    model, optimizer = build()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(TrainerStateRefused) as refused:
        load_trainer_state(model, optimizer, directory, manifest)
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items()), "loaded before refusing"
    assert refused.value.exit_code == 3
    return str(refused.value)


def test_each_recorded_digest_and_size_is_the_files_on_disk(saved: tuple) -> None:
    _, _, directory, manifest = saved
    assert_manifest_is_the_disk(directory, manifest)
    assert manifest.describe()[0].startswith("trainer state: DCP, written at world size 1, 2 files")


def test_a_torn_shard_is_refused_naming_it(saved: tuple) -> None:
    _, _, directory, manifest = saved
    shard = directory / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 1)
    assert "__0_0.distcp is" in refusal(directory, manifest)


def test_a_missing_shard_is_refused_naming_it(saved: tuple) -> None:
    _, _, directory, manifest = saved
    (directory / "__0_0.distcp").unlink()
    assert "__0_0.distcp is missing" in refusal(directory, manifest)


def test_a_foreign_shard_of_the_same_size_is_refused_naming_it(saved: tuple, tmp_path: Path) -> None:
    model, optimizer, directory, manifest = saved
    step(model, optimizer, batches()[2])
    other = save_trainer_state(model, optimizer, tmp_path / "other")
    assert other.files["__0_0.distcp"].size == manifest.files["__0_0.distcp"].size
    shutil.copy(tmp_path / "other" / "__0_0.distcp", directory / "__0_0.distcp")
    assert "__0_0.distcp has BLAKE3" in refusal(directory, manifest)
    (directory / "__0_0.distcp").unlink()
    shutil.copy(tmp_path / "other" / METADATA_FILE, directory / "stray")
    shutil.copy(tmp_path / "other" / "__0_0.distcp", directory / "__0_0.distcp")
    assert "stray is not in the manifest" in refusal(directory, manifest)


def test_a_tied_weight_is_stored_once(saved: tuple) -> None:
    model, _, directory, _ = saved
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
    steps = len(list(model.parameters()))  # AdamW's step count, a float32 scalar per parameter
    metadata = FileSystemReader(directory).read_metadata()
    assert not [name for name in metadata.state_dict_metadata if "lm_head" in name]
    tensors = {name: entry for name, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, TensorStorageMetadata)}
    stored = sum(entry.size.numel() * entry.properties.dtype.itemsize for entry in tensors.values())
    # Weights, exp_avg and exp_avg_sq once each; on disk, DCP's framing of each item (about 1 KB) besides.
    assert stored == 3 * unique + 4 * steps
    items = len(metadata.state_dict_metadata)
    assert stored < shard_bytes(directory) < stored + 2048 * items
