"""The trainer's state as a ``torch.distributed.checkpoint`` (DCP) directory that every rank writes its own part of.

Why DCP: a whole-state checkpoint gathers the model and AdamW state into rank 0's host memory and writes it through
one process (minutes and a host OOM at 7B with fp32 masters).  Here each rank writes only its own shards, in
parallel, and a load at any world size reads the slices it needs (DCP reshards N -> M, to and from 1).

- The state is keyed by parameter name (``get_state_dict`` with a flattened optimizer state), never by a parameter's
  index or a rank's shard, so it reshards; a tied weight (the output head on the embedding) is stored once, under
  the name ``named_parameters`` gives it, and loaded back into every name that shares it.
- Each file's BLAKE3 digest is computed from the bytes as they are written (``DigestingFileSystemWriter``): no
  second read pass over a checkpoint the size of the model.  Files are fsynced before DCP writes ``.metadata``,
  which it writes last, on the coordinator, once every rank's files are on disk.
- The manifest, ``{file: (bytes, blake3)}`` over every rank's files and ``.metadata``, comes back to every rank, for
  the bundle to record.  A load checks the directory against it before anything is read into the model: a
  missing, truncated, foreign or unlisted file is refused naming the file (exit 3), and ``.metadata`` (a pickle) is
  unpickled only once its digest matches.
- World size 1 writes the same format, with no process group (DCP's ``no_dist``).

Every rank of a group must call ``save_trainer_state``/``write_trainer_state``/``load_trainer_state`` together (they
run collectives).  Off the train step's critical path: ``capture_trainer_state`` (a host copy of the rank's shards,
at a step boundary) then ``write_trainer_state`` on a thread beside training, over a process group of its own
(``process_group``, e.g. ``dist.new_group(backend="gloo")`` made once at setup): collectives of two threads on one
group would interleave.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import blake3
import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from scd.errors import InvariantViolation

METADATA_FILE = ".metadata"  # DCP's own name for the checkpoint's index of every tensor's file and offsets
# World size 1 saves and loads with no process group on purpose (the same format, DCP's no_dist): not worth a
# warning on every checkpoint.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# Parameter names, not indices or shards, key the optimizer state: what lets DCP reshard it.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainerStateRefused(InvariantViolation):
    """A trainer state directory that does not match its manifest; names the directory and each bad file."""

    def __init__(self, directory: Path, problems: list[str]) -> None:
        super().__init__(f"trainer state {directory}: " + "; ".join(problems))
        self.directory = directory
        self.problems = problems


class ShardFile(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    size: int  # bytes
    blake3: str


class TrainerStateManifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a save wrote: every rank's files and ``.metadata``, by name in the directory."""

    world_size: int  # the world size it was written at; any other loads it too
    files: dict[str, ShardFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def describe(self) -> list[str]:
        """Lines for ``scd checkpoint inspect``: the world size, then each file and its bytes."""
        lines = [f"trainer state: DCP, written at world size {self.world_size}, {len(self.files)} files, "
                 f"{self.total_bytes} bytes"]
        lines += [f"  {name}  {self.files[name].size} bytes  blake3 {self.files[name].blake3[:16]}"
                  for name in sorted(self.files)]
        return lines


class _DigestingStream:
    """A file being written whose bytes are hashed and counted on their way to the disk."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.size = 0

    def write(self, data: Any) -> int:
        self._hash.update(data)
        written = cast(int, self._file.write(data))
        self.size += written
        return written

    def tell(self) -> int:
        return cast(int, self._file.tell())

    def fileno(self) -> int:
        return cast(int, self._file.fileno())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def digest(self) -> ShardFile:
        return ShardFile(self.size, self._hash.hexdigest())


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, recording each written file's size and digest by name (``.metadata`` is written as
    ``.metadata.tmp`` and renamed: the record follows the rename).  DCP writes a rank's files on several threads."""

    def __init__(self) -> None:
        self.written: dict[str, ShardFile] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digesting = _DigestingStream(stream)
            yield digesting
        with self._lock:
            self.written[Path(path).name] = digesting.digest()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class DigestingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (files fsynced, one per rank and thread) that digests every file as it writes it,
    into ``written``, and refuses a directory that already holds a checkpoint."""

    def __init__(self, path: Path, *, thread_count: int = 1) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                         overwrite=False)
        self.fs = _DigestingFileSystem()

    @property
    def written(self) -> dict[str, ShardFile]:
        return cast(_DigestingFileSystem, self.fs).written


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier one -> that earlier name (the one
    ``named_parameters`` and the optimizer use)."""
    owner = {id(p): name for name, p in model.named_parameters()}
    return {name: owner[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if owner[id(p)] != name}


def _rank_and_world(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_gather(value: Any, process_group: dist.ProcessGroup | None) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, value, group=process_group)
    return gathered


def trainer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of the state, the live tensors (sharded ones as DTensors), each tied weight once."""
    weights, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    tied = _tied_names(model)
    return {"model": {name: t for name, t in weights.items() if name not in tied}, "optimizer": optimizer_state}


def capture_trainer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of the state copied to host memory (a sharded tensor stays a DTensor over its copied
    shard: DCP's own staging), for ``write_trainer_state`` to write while training goes on.  No collective."""
    return cast(dict[str, Any], BlockingAsyncStager().stage(trainer_state(model, optimizer)))


def write_trainer_state(state: dict[str, Any], directory: Path, *, process_group: dist.ProcessGroup | None = None,
                        thread_count: int = 1) -> TrainerStateManifest:
    """Write this rank's ``state`` (``trainer_state``'s or ``capture_trainer_state``'s) into ``directory`` (new or
    empty), each file digested as written and fsynced, ``.metadata`` last; returns the whole manifest on every rank.
    Blocking; every rank calls it.

    The directory's own entries are the caller's to fsync (``scd.checkpoint.layout.fsync_path``) before its commit
    marker, with the rest of the bundle: the commit protocol lives in one place."""
    writer = DigestingFileSystemWriter(directory, thread_count=thread_count)
    dcp.save(state, storage_writer=writer, process_group=process_group)
    files: dict[str, ShardFile] = {}
    for written in _all_gather(writer.written, process_group):
        files.update(written)
    return TrainerStateManifest(world_size=_rank_and_world(process_group)[1], files=files)


def save_trainer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *,
                       process_group: dist.ProcessGroup | None = None, thread_count: int = 1) -> TrainerStateManifest:
    """``write_trainer_state`` of the live state: no copy, the model must not change until it returns."""
    return write_trainer_state(trainer_state(model, optimizer), directory, process_group=process_group,
                               thread_count=thread_count)


def _file_problem(path: Path, expected: ShardFile) -> str | None:
    """What is wrong with one file (present) against its manifest entry, or None."""
    size = path.stat().st_size
    if size != expected.size:
        return f"{path.name} is {size} bytes, the manifest says {expected.size} (torn or foreign)"
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    digest.update_mmap(path)
    if digest.hexdigest() != expected.blake3:
        return f"{path.name} has BLAKE3 {digest.hexdigest()[:16]}..., the manifest says {expected.blake3[:16]}... " \
               "(corrupt or foreign)"
    return None


def verify_trainer_state(directory: Path, manifest: TrainerStateManifest, *,
                         process_group: dist.ProcessGroup | None = None) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, once the directory holds exactly the manifest's files, each of its size
    and digest, and ``.metadata`` names no other file; else refused.  Ranks split the hashing; every rank raises the
    same error.  Blocking."""
    if not directory.is_dir():
        raise TrainerStateRefused(directory, ["the directory is missing"])
    if METADATA_FILE not in manifest.files:
        raise TrainerStateRefused(directory, [f"the manifest lists no {METADATA_FILE}"])
    present = {p.name for p in directory.iterdir()}
    problems = [f"{name} is missing" for name in sorted(set(manifest.files) - present)]
    problems += [f"{name} is not in the manifest (foreign)" for name in sorted(present - set(manifest.files))]
    if not problems:
        rank, world = _rank_and_world(process_group)
        names = sorted(manifest.files)[rank::world]
        mine = [problem for name in names if (problem := _file_problem(directory / name, manifest.files[name]))]
        problems = [problem for found in _all_gather(mine, process_group) for problem in found]
    if problems:
        raise TrainerStateRefused(directory, sorted(problems))
    # Unpickled only now that its digest matched.
    metadata = FileSystemReader(directory).read_metadata()
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(manifest.files))
    if unlisted:
        raise TrainerStateRefused(directory, [f"{METADATA_FILE} names {name}, which the manifest does not list"
                                              for name in unlisted])
    return metadata


def load_trainer_state(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                       manifest: TrainerStateManifest, *, process_group: dist.ProcessGroup | None = None) -> None:
    """Check ``directory`` against ``manifest`` (``verify_trainer_state``), then load this rank's part of the weights
    and optimizer state from it, whatever world size wrote it.  Blocking; every rank calls it.

    The optimizer's ``param_groups`` (lr, weight decay) come back as saved; a caller that configures them anew
    sets them after."""
    verify_trainer_state(directory, manifest, process_group=process_group)
    state = trainer_state(model, optimizer)  # the tensors DCP reads into (a fresh optimizer's state is made)
    dcp.load(state, storage_reader=FileSystemReader(directory), process_group=process_group)
    weights = state["model"]
    tied = {name: weights[owner] for name, owner in _tied_names(model).items()}
    set_state_dict(model, optimizer, model_state_dict={**weights, **tied}, optim_state_dict=state["optimizer"],
                   options=_OPTIONS)


# What ``scd export`` holds at once: the weights of one output file (Hugging Face's default shard size).
EXPORT_FILE_BYTES = 5 * 10**9


def export_safetensors(directory: Path, manifest: TrainerStateManifest, out_dir: Path, dtype: torch.dtype, *,
                       max_file_bytes: int = EXPORT_FILE_BYTES) -> list[str]:
    """The checkpoint's weights, checked first (``verify_trainer_state``), as Hugging Face safetensors in ``out_dir``
    (which must exist), floating ones cast to ``dtype``; returns the files written.  One process at any world size
    that wrote it: the weights are read a file's worth at a time (at most ``max_file_bytes`` as saved, a larger
    single tensor alone), so the process never holds more than one output file of the model.  A tied weight is in
    the files once, under the name the model's parameters use; ``transformers`` ties the other on load.  More than
    one file gets ``model.safetensors.index.json``.  Blocking."""
    from safetensors.torch import save_file

    metadata = verify_trainer_state(directory, manifest)
    saved = {key.removeprefix("model."): entry for key, entry in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    groups: list[list[str]] = [[]]
    budget = 0
    for name, entry in saved.items():
        size = entry.size.numel() * entry.properties.dtype.itemsize
        if groups[-1] and budget + size > max_file_bytes:
            groups.append([])
            budget = 0
        groups[-1].append(name)
        budget += size
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, group in zip(names, groups, strict=True):
        loaded = {name: torch.empty(saved[name].size, dtype=saved[name].properties.dtype) for name in group}
        dcp.load({"model": loaded}, storage_reader=FileSystemReader(directory))
        out = {name: t.to(dtype) if t.is_floating_point() else t for name, t in loaded.items()}
        del loaded
        save_file(out, out_dir / file_name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(group, file_name))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_bytes(msgspec.json.encode(index))
        names.append("model.safetensors.index.json")
    return names

