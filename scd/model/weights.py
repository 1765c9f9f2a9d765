"""The weights of a trainer group as a mapping that fetches them a decoder layer at a time.

A generation backend reads a weight sync's tensors in order (``Mapping`` iteration); a
``ChunkedWeights`` holds one chunk (a decoder layer, or one of the tensors outside the layers)
at a time, so scd's process never holds a second copy of the model.  Reading out of order
works, fetching again.  ``save_digested`` writes a trainer state file and hashes it on the way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


@dataclass(frozen=True, slots=True)
class WeightEntry:
    name: str
    dtype: str  # torch dtype without its "torch." prefix
    shape: tuple[int, ...]


def layer_chunks(names: Sequence[str]) -> list[list[str]]:
    """``names`` in order, cut where the decoder layer changes; a tensor outside the layers travels alone."""
    chunks: list[list[str]] = []
    last: str | None = None
    for name in names:
        match = _LAYER.match(name)
        layer = match.group(1) if match else None
        if layer is None or layer != last:
            chunks.append([])
        chunks[-1].append(name)
        last = layer
    return chunks


class ChunkedWeights(Mapping[str, torch.Tensor]):
    """The group's whole weights, none aliasing another, fetched by ``fetch`` (blocking: call it from a
    worker thread) one chunk at a time.  ``fetch`` returns a chunk's tensors and the bytes its all-gathers
    produced, counted in ``gathered_bytes``."""

    def __init__(self, entries: Sequence[WeightEntry],
                 fetch: Callable[[list[str]], tuple[dict[str, torch.Tensor], int]]) -> None:
        self.entries = tuple(entries)
        self._chunks = layer_chunks([e.name for e in self.entries])
        self._chunk_of = {name: i for i, chunk in enumerate(self._chunks) for name in chunk}
        self._fetch = fetch
        self._held: tuple[int, dict[str, torch.Tensor]] = (-1, {})
        self.fetches = 0
        self.gathered_bytes = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        chunk = self._chunk_of[name]
        if self._held[0] != chunk:
            self._held = (-1, {})  # drop the previous chunk before the next one arrives
            tensors, gathered_bytes = self._fetch(self._chunks[chunk])
            self._held = (chunk, tensors)
            self.fetches += 1
            self.gathered_bytes += gathered_bytes
        return self._held[1][name]

    def __iter__(self) -> Iterator[str]:
        return (e.name for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


StorageKey = tuple[int, int, torch.Size, torch.dtype]


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """Equal for two tensors that are the same memory seen alike: a tied embedding under its two names."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.dtype


def unaliased(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``weights`` without tensors that alias an earlier one (tied embeddings): what a checkpoint holds
    and a sync sends.  A ``ChunkedWeights`` is built that way."""
    if isinstance(weights, ChunkedWeights):
        return weights
    seen: set[StorageKey] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


class _DigestingWriter:
    """A file opened for writing that BLAKE3-hashes the bytes as they pass, so that a file scd writes itself
    (the policy's, the sidecar) costs no second read to digest: ``torch.save`` writes through it."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")
        self._hash = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def write(self, data: bytes | memoryview) -> int:
        self._hash.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> _DigestingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def save_digested(state: dict[str, Any], path: Path) -> str:
    """``torch.save`` to ``path``; the file's BLAKE3 digest (as a bundle records it), hashed as it was written
    instead of read back after."""
    with _DigestingWriter(path) as file:
        torch.save(state, file)
    return file.hexdigest()
