"""The replay index: metadata of every ready group whose rows live in TQ.

The index holds no tensors.  It is the controller's side of the exact-inventory
invariant: the union of ``sample_ids`` over all groups must equal TQ's canonical
partition, row for row.
"""

from __future__ import annotations

import hashlib

import msgspec
import torch

from scd.errors import InvariantViolation
from scd.records import Rollout


class GroupMeta(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str
    epoch: int
    prompt_id: int
    sample_ids: tuple[str, ...]
    start_weight_version: int
    end_weight_version: int
    prompt_len: int
    seq_lens: tuple[int, ...]
    fields: tuple[str, ...]
    rewards: tuple[float, ...]
    weight_versions: tuple[int, ...]
    target_step: int | None = None
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    admitted_at: float = 0.0
    committed_at: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)


def rollouts_of(group: GroupMeta, input_ids: list[torch.Tensor], logprobs: list[torch.Tensor]) -> list[Rollout]:
    """Rebuild a group's rollouts from its TQ tensors and its metadata, checking the row lengths."""
    got = tuple(len(t) for t in input_ids)
    if got != group.seq_lens:
        raise InvariantViolation(f"rows read for group {group.group_id} have lengths {list(got)}, "
                                 f"the replay index says {list(group.seq_lens)}")
    return [
        Rollout(ids, lp, group.prompt_len, reward, version)
        for ids, lp, reward, version in zip(input_ids, logprobs, group.rewards, group.weight_versions, strict=True)
    ]


def sample_ids_for(group_id: str, group_size: int) -> tuple[str, ...]:
    """Deterministic keys, so a retried commit or a rollback is idempotent."""
    return tuple(f"{group_id}/{sibling}" for sibling in range(group_size))


class ReplayIndex:
    def __init__(self) -> None:
        # Insertion order is commit order: samplers rely on it for FIFO selection.
        self._groups: dict[str, GroupMeta] = {}
        self._rows = 0

    def add(self, group: GroupMeta) -> None:
        if group.group_id in self._groups:
            raise ValueError(f"group {group.group_id} is already in the replay index")
        self._groups[group.group_id] = group
        self._rows += len(group.sample_ids)

    def remove(self, group_id: str) -> GroupMeta:
        group = self._groups.pop(group_id)
        self._rows -= len(group.sample_ids)
        return group

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, group_id: str) -> GroupMeta:
        return self._groups[group_id]

    def groups(self) -> list[GroupMeta]:
        return list(self._groups.values())

    @property
    def rows(self) -> int:
        return self._rows

    def sample_ids(self) -> set[str]:
        return {sid for g in self._groups.values() for sid in g.sample_ids}

    def digest(self) -> str:
        """SHA-256 over a canonical form of every group's metadata."""
        h = hashlib.sha256()
        for group_id in sorted(self._groups):
            h.update(msgspec.json.encode(self._groups[group_id], order="sorted"))
            h.update(b"\n")
        return h.hexdigest()


def require_exact_inventory(expected: set[str], actual: set[str], where: str) -> None:
    """Exact inventory: TQ's canonical ids must equal the replay index's, no more and no fewer."""
    missing = sorted(expected - actual)
    unexpected = sorted(actual - expected)
    if missing or unexpected:
        raise InvariantViolation(
            f"{where}: replay index and TransferQueue disagree: {len(missing)} missing from TQ "
            f"(first: {missing[:10]}), {len(unexpected)} unexpected in TQ (first: {unexpected[:10]})"
        )
