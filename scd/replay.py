"""The replay index: metadata of every ready group whose rows live in TQ.

The index holds no tensors.  It is the controller's side of the exact-inventory
invariant: its group ids must equal TQ's canonical partition (one key per group),
key for key.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence

import msgspec
import torch

from scd.errors import InvariantViolation
from scd.records import Rollout


class GroupMeta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    group_id: str
    epoch: int
    prompt_id: int
    sample_ids: tuple[str, ...]
    start_weight_version: int
    end_weight_version: int
    prompt_len: int
    seq_lens: tuple[int, ...]
    rewards: tuple[float, ...]
    weight_versions: tuple[int, ...]
    target_step: int | None = None
    admitted_at: float = 0.0
    committed_at: float = 0.0
    # Each reward's (and reward part's) mean over the siblings that have it; none in bundles before schema 6.
    reward_components: dict[str, float] = {}
    # Per sibling, whether it ended by length (``Rollout.truncated``); none in bundles written before it was
    # recorded, whose rows read as not truncated.
    truncated: tuple[bool, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def completion_tokens(self) -> int:
        """The tokens generation made (each row less its prompt): what goodput and waste count."""
        return self.tokens - self.prompt_len * len(self.seq_lens)


def mean_reward_components(groups: Sequence[GroupMeta]) -> dict[str, float]:
    """Each reward component's mean over the groups that have it (a group's is its siblings' mean; groups
    of bundles before schema 6 have none)."""
    names = sorted({name for group in groups for name in group.reward_components})
    return {name: statistics.fmean(g.reward_components[name] for g in groups if name in g.reward_components)
            for name in names}


def rollouts_of(group: GroupMeta, input_ids: list[torch.Tensor], logprobs: list[torch.Tensor]) -> list[Rollout]:
    """Rebuild a group's rollouts from its TQ tensors and its metadata, checking the row lengths."""
    got = tuple(len(t) for t in input_ids)
    if got != group.seq_lens:
        raise InvariantViolation(f"rows read for group {group.group_id} have lengths {list(got)}, "
                                 f"the replay index says {list(group.seq_lens)}")
    single_version = group.start_weight_version == group.end_weight_version
    truncated = group.truncated or (False,) * len(group.seq_lens)
    return [
        Rollout(ids, lp, group.prompt_len, reward, version, single_version, cut)
        for ids, lp, reward, version, cut in zip(input_ids, logprobs, group.rewards, group.weight_versions,
                                                  truncated, strict=True)
    ]


def sample_ids_for(group_id: str, group_size: int) -> tuple[str, ...]:
    """Deterministic keys, so a retried commit or a rollback is idempotent."""
    return tuple(f"{group_id}/{sibling}" for sibling in range(group_size))


def group_hash(group: GroupMeta) -> bytes:
    """SHA-256 of the group's canonical JSON.  A group that records no truncated flags (read from a bundle
    written before they were) hashes without the key, as it was hashed when that bundle was saved."""
    document = msgspec.to_builtins(group)
    if not group.truncated:
        del document["truncated"]
    return hashlib.sha256(msgspec.json.encode(document, order="sorted")).digest()


class ReplayIndex:
    """Kept incrementally (group hashes, the sample-id set) so that a checkpoint's cut is cheap."""

    def __init__(self) -> None:
        # Insertion order is commit order: samplers rely on it for FIFO selection.
        self._groups: dict[str, GroupMeta] = {}
        self._hashes: dict[str, bytes] = {}
        self._sample_ids: set[str] = set()

    def add(self, group: GroupMeta) -> None:
        if group.group_id in self._groups:
            raise ValueError(f"group {group.group_id} is already in the replay index")
        self._groups[group.group_id] = group
        self._hashes[group.group_id] = group_hash(group)
        self._sample_ids.update(group.sample_ids)

    def retarget(self, group_id: str, target_step: int | None) -> None:
        """Give a ready group another target step (a gated sampler's state re-derived at restore)."""
        self.replace(msgspec.structs.replace(self._groups[group_id], target_step=target_step))

    def replace(self, group: GroupMeta) -> None:
        """Put ``group`` in place of the ready group of its id, in its place in commit order: its target step
        re-derived, or its rewards scored again (a restore under a changed reward set); its rows are the same."""
        self._groups[group.group_id] = group
        self._hashes[group.group_id] = group_hash(group)

    def remove(self, group_id: str) -> GroupMeta:
        group = self._groups.pop(group_id)
        del self._hashes[group_id]
        self._sample_ids.difference_update(group.sample_ids)
        return group

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[GroupMeta]:
        return list(self._groups.values())

    @property
    def rows(self) -> int:
        return len(self._sample_ids)

    def sample_ids(self) -> set[str]:
        """The live set of every ready row's id; copy it to keep it past the next mutation."""
        return self._sample_ids

    def keys(self) -> set[str]:
        """TQ's keys for the ready groups (their group ids), as a new set."""
        return set(self._groups)

    def digest(self) -> str:
        """SHA-256 over every group's metadata hash (of its canonical JSON), in group-id order."""
        h = hashlib.sha256()
        for group_id in sorted(self._hashes):
            h.update(self._hashes[group_id])
        return h.hexdigest()


def require_exact_inventory(expected: set[str], actual: set[str], where: str) -> None:
    """Exact inventory: TQ's canonical keys must equal the replay index's groups, no more and no fewer."""
    missing = sorted(expected - actual)
    unexpected = sorted(actual - expected)
    if missing or unexpected:
        raise InvariantViolation(
            f"{where}: replay index and TransferQueue disagree: {len(missing)} groups missing from TQ "
            f"(first: {missing[:10]}), {len(unexpected)} unexpected in TQ (first: {unexpected[:10]})"
        )


def require_cut_inventory(cut: set[str], listed: set[str], uncut: set[str], where: str) -> None:
    """Exact inventory of a cut whose TQ save overlapped mutations: TQ lists every group of the cut,
    and every other key it lists is one of ``uncut`` (put after the cut, or a clear still owed)."""
    missing = sorted(cut - listed)
    unexplained = sorted(listed - cut - uncut)
    if missing or unexplained:
        raise InvariantViolation(
            f"{where}: the cut and TransferQueue disagree: {len(missing)} groups of the cut missing from TQ "
            f"(first: {missing[:10]}), {len(unexplained)} groups in TQ that are neither in the cut nor put "
            f"after it (first: {unexplained[:10]})"
        )
