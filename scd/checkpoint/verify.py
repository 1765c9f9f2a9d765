"""Offline verification of a bundle: everything that can be checked without loading TQ.

``scd checkpoint verify`` and restore run the same checks on a bundle's own content (``verify_bundle``
is ``verify_files`` then ``read_metadata``, which restore calls in turn), so a bundle that verifies is
one restore reads; restore then checks it against the run's config (``check_against_config``).

``verify_bundle`` never unpickles anything: TQ's files are checked by digest (BLAKE3)
against ``training_info.json`` (recorded right after the live exact-inventory
check), so a tampered ``data_plane/`` is rejected before TQ would load it.
Every file decodes as its ``scd.schema`` struct, and every group is checked on
its own: a group can only ever name its own rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import orjson

from scd.checkpoint import layout
from scd.config import NOT_SET, Config, is_reward_setting
from scd.dataloader import PromptOrder
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState, group_id_for
from scd.records import COMPLETE, Completion, FinishReason, Prefix
from scd.replay import GroupMeta, ReplayIndex, sample_ids_for
from scd.rewards import Scored
from scd.rollouts import RolloutsCut
from scd.samplers import DispatchView, SamplerStateError
from scd.schema import DataloaderDocument, SchemaError, Sidecar, TrainingInfo, decode
from scd.state import ControllerState


class BundleError(InvariantViolation):
    """A bundle that must not be restored, with the reason and the bundle's path."""

    def __init__(self, bundle: Path, reason: str) -> None:
        super().__init__(f"checkpoint {bundle}: {reason}")
        self.bundle = bundle
        self.reason = reason


@dataclass(slots=True)
class VerifiedBundle:
    path: Path
    info: TrainingInfo
    sidecar: Sidecar
    dataloader: DataloaderDocument
    ledger: PromptLedger
    index: ReplayIndex  # the sidecar's groups, checked one by one and against the recorded digest
    rollouts: RolloutsCut  # the cut's own siblings of in-flight groups, each checked against the cut


def legacy_replay_error(path: Path) -> BundleError:
    return BundleError(path.parent, f"holds a legacy tensor-bearing {layout.LEGACY_REPLAY_FILE}: scd keeps "
                                    "rollout tensors only in TQ's native snapshot. Start this run from a bundle "
                                    "written by scd (--restore-from), or move the legacy directory out of "
                                    "checkpointing.dir to start empty")


def _require(ok: bool, bundle: Path, reason: str) -> None:
    if not ok:
        raise BundleError(bundle, reason)


def check_group(group: GroupMeta, group_size: int) -> str:
    """Why ``group`` is malformed, or "": per-sibling fields line up and its ids are its own."""
    lengths = {len(group.sample_ids), len(group.seq_lens), len(group.rewards), len(group.weight_versions)}
    if lengths != {group_size}:
        return (f"group {group.group_id} has {len(group.sample_ids)} sample_ids, {len(group.seq_lens)} seq_lens, "
                f"{len(group.rewards)} rewards and {len(group.weight_versions)} weight_versions; "
                f"the group size is {group_size}")
    if group.truncated and len(group.truncated) != group_size:
        return f"group {group.group_id} has {len(group.truncated)} truncated flags; the group size is {group_size}"
    if group.group_id != group_id_for(group.epoch, group.prompt_id):
        return f"group {group.group_id} is not prompt {group.prompt_id} of epoch {group.epoch}"
    if group.sample_ids != sample_ids_for(group.group_id, group_size):
        return f"group {group.group_id} names rows that are not its own: {list(group.sample_ids)[:3]}"
    return ""


# TQ 0.1.11's SimpleStorage writes one ``simple_storage/su_<position>_<unit id>.pkl`` per unit.
_STORAGE_UNIT_FILE = re.compile(rf"^{layout.DATA_PLANE_DIR}/simple_storage/su_\d+_[^/]+\.pkl$")


def storage_units_of(info: TrainingInfo) -> int:
    """TQ storage units the bundle's snapshot was saved from: recorded, or (a bundle written before
    scd recorded it) counted from the unit files of TQ's snapshot, one per unit."""
    if info.storage_units is not None:
        return info.storage_units
    return sum(1 for name in info.files if _STORAGE_UNIT_FILE.match(name))


def verify_bundle(bundle: Path) -> VerifiedBundle:
    """Schema, file digests, each group, sidecar digest and counts, ledger consistency; raises ``BundleError``."""
    return read_metadata(bundle, verify_files(bundle))


def verify_files(bundle: Path, *, hashed_while_read: Collection[str] = ()) -> TrainingInfo:
    """The commit marker, ``training_info.json`` and every file's BLAKE3 digest but those of
    ``hashed_while_read`` (restore hashes the trainer state's files while it loads them); nothing else is
    decoded."""
    _require(bundle.is_dir(), bundle, "is not a directory")
    if (bundle / layout.LEGACY_REPLAY_FILE).exists():
        raise legacy_replay_error(bundle / layout.LEGACY_REPLAY_FILE)
    _require(not bundle.name.endswith(".tmp"), bundle, "is an unfinished .tmp directory")
    marker = bundle / layout.COMMIT_MARKER
    _require(marker.is_file(), bundle, f"has no {layout.COMMIT_MARKER} marker: it was never finalized")
    try:
        info = decode(bundle / layout.TRAINING_INFO_FILE, TrainingInfo)
    except SchemaError as exc:
        raise BundleError(bundle, str(exc)) from None
    _require(marker.read_bytes().decode(errors="replace") == layout.sha256_file(bundle / layout.TRAINING_INFO_FILE),
             bundle, f"{layout.TRAINING_INFO_FILE} does not match its commit marker (edited after finalize)")
    # Every train step advances both by one from 0 (``ControllerState.finish_step``) and a restore
    # installs both as recorded: where they differ the bundle was edited or written wrong, and every
    # staleness decision after the restore would be off by the difference.
    # Restore picks the newest bundle, and the checkpointer skips a step whose bundle exists, by the directory's
    # name: a name that disagrees with the content would restore the wrong step and hide the right one.
    named = layout.step_of(bundle)
    _require(named is None or named == info.step, bundle,
             f"is named for step {named} but its {layout.TRAINING_INFO_FILE} records step {info.step}")
    _require(info.weight_version == info.step, bundle,
             f"{layout.TRAINING_INFO_FILE} records step {info.step} but weight_version {info.weight_version}; "
             "every train step advances both by one from 0, so they must be equal")

    present = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    present -= {layout.TRAINING_INFO_FILE, layout.COMMIT_MARKER}
    missing = sorted(set(info.files) - present)
    unexpected = sorted(present - set(info.files))
    _require(not missing, bundle, f"files missing: {missing[:10]}")
    _require(not unexpected, bundle, f"unexpected files (not written by scd): {unexpected[:10]}")
    for required in (layout.DATALOADER_FILE, layout.SIDECAR_FILE, layout.MODEL_FILE, layout.OPTIMIZER_FILE):
        _require(required in info.files, bundle, f"{required} is not part of the bundle")
    _require(any(name.startswith(layout.DATA_PLANE_DIR + "/") for name in info.files), bundle,
             f"holds no {layout.DATA_PLANE_DIR}/ (TQ's native snapshot)")
    for name, digest in info.files.items():
        if name not in hashed_while_read:
            require_digest(bundle, name, layout.file_digest(bundle / name), digest)
    return info


def require_digest(bundle: Path, name: str, computed: str, recorded: str) -> None:
    _require(computed == recorded, bundle,
             f"{name} does not match its BLAKE3 digest in {layout.TRAINING_INFO_FILE} (corrupt or tampered)")


def read_metadata(bundle: Path, info: TrainingInfo) -> VerifiedBundle:
    """Decode the sidecar, dataloader and ledger of a bundle whose files verified; each group checked on its own."""
    try:
        sidecar = decode(bundle / layout.SIDECAR_FILE, Sidecar)
        dataloader = decode(bundle / layout.DATALOADER_FILE, DataloaderDocument)
        ledger = PromptLedger.from_document(sidecar.ledger)
    except (SchemaError, ValueError) as exc:
        raise BundleError(bundle, str(exc)) from None
    index = ReplayIndex()
    for group in sidecar.groups:
        problem = check_group(group, info.group_size)
        _require(not problem, bundle, problem)
        _require(group.group_id not in index, bundle, f"group {group.group_id} appears twice")
        index.add(group)
    _require(sidecar.partition == info.partition, bundle, "sidecar and training_info name other partitions")
    _require(sidecar.sampler.name == info.sampler, bundle, "sidecar and training_info name other samplers")
    _require(len(sidecar.groups) == info.groups, bundle,
             f"sidecar holds {len(sidecar.groups)} groups, training_info says {info.groups}")
    _require(index.rows == info.samples, bundle,
             f"sidecar holds {index.rows} samples, training_info says {info.samples}")
    digest = index.digest()
    _require(digest == info.replay_digest == sidecar.replay_digest, bundle,
             f"replay digest mismatch: sidecar content {digest[:12]}, recorded {info.replay_digest[:12]}")
    ready = set(ledger.in_state(PromptState.READY))
    _require(ready == {g.group_id for g in sidecar.groups}, bundle,
             "ledger's ready prompts and the sidecar's groups differ")
    _require(dataloader.epoch == info.epoch, bundle, "dataloader epoch differs from training_info")
    rollouts = checked_rollouts_cut(bundle, sidecar, ledger, info.weight_version, info.group_size)
    return VerifiedBundle(bundle, info, sidecar, dataloader, ledger, index, rollouts)


def checked_rollouts_cut(bundle: Path, sidecar: Sidecar, ledger: PromptLedger, weight_version: int,
                         group_size: int) -> RolloutsCut:
    """The bundle's siblings of in-flight groups it did not stage, each checked against its cut: exit 3
    naming the group of the first that is wrong.

    Each belongs to a sibling of a group in flight at the cut, not staged there, listed once; its tokens
    and logprobs are as many, and no version is above the cut's (taken at the cut, before the next step).
    A prefix's version runs start at its first token and ascend; a finished sibling ends in eos, stop or
    length.  A score is for a finished sibling of the cut, staged or listed, of the very version; once each.
    """
    prefixes: dict[str, dict[int, Prefix]] = {}
    finished: dict[str, dict[int, Completion]] = {}
    seen: set[tuple[str, int]] = set()

    def checked(what: str, group_id: str, index: int, tokens: int, logprobs: int) -> Callable[[str], NoReturn]:
        def refuse(why: str) -> NoReturn:
            raise BundleError(bundle, f"{what} {index} of group {group_id} {why}")

        if ledger.state_of(group_id) is not PromptState.IN_FLIGHT:
            refuse(f"is for a group the cut's ledger does not hold in flight ({ledger.state_of(group_id)})")
        if not 0 <= index < group_size or (group_id, index) in seen:
            refuse(f"names a sibling index out of 0..{group_size - 1}, or one named before")
        if any(i == index for i, _ in ledger.entry(group_id).staged):
            refuse("is for a sibling the cut staged")
        if tokens == 0 or logprobs != tokens:
            refuse(f"holds {tokens} tokens and {logprobs} logprobs")
        seen.add((group_id, index))
        return refuse

    for p in sidecar.prefixes:
        refuse = checked("the prefix of sibling", p.group_id, p.index, len(p.token_ids), len(p.logprobs))
        starts = [start for start, _ in p.version_runs]
        versions = [version for _, version in p.version_runs]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= len(p.token_ids):
            refuse(f"has version runs starting at {starts} for {len(p.token_ids)} tokens")
        if versions != sorted(versions) or versions[0] < 0 or versions[-1] > weight_version:
            refuse(f"has token versions {versions}, above the cut's weight version {weight_version} or "
                   "out of order")
        prefixes.setdefault(p.group_id, {})[p.index] = Prefix(
            tuple(p.token_ids), tuple(p.logprobs), tuple((start, version) for start, version in p.version_runs))
    for f in sidecar.finished_siblings:
        refuse = checked("finished sibling", f.group_id, f.index, len(f.token_ids), len(f.logprobs))
        if not 0 <= f.weight_version <= weight_version:
            refuse(f"has weight version {f.weight_version}, above the cut's {weight_version} or negative")
        if f.finish_reason not in COMPLETE:
            refuse(f"ends {f.finish_reason!r}")
        finished.setdefault(f.group_id, {})[f.index] = Completion(
            f.token_ids, f.logprobs, FinishReason(f.finish_reason), f.weight_version)
    scores: dict[str, dict[int, Scored]] = {}
    for s in sidecar.sibling_scores:
        where = f"the score of sibling {s.index} of group {s.group_id}"
        if ledger.state_of(s.group_id) is not PromptState.IN_FLIGHT:
            raise BundleError(bundle, f"{where} is for a group the cut's ledger does not hold in flight")
        versions = dict(ledger.entry(s.group_id).staged)
        if s.group_id in finished and s.index in finished[s.group_id]:
            versions[s.index] = finished[s.group_id][s.index].weight_version
        if versions.get(s.index) != s.weight_version or s.index in scores.get(s.group_id, {}):
            raise BundleError(bundle, f"{where} (version {s.weight_version}) is for no finished sibling of the "
                                      "cut, or was listed before")
        if not all(map(math.isfinite, (s.total, *s.components.values()))):
            raise BundleError(bundle, f"{where} is not finite")
        scores.setdefault(s.group_id, {})[s.index] = Scored(s.total, dict(s.components))
    return RolloutsCut(finished, prefixes, scores)


def check_finished_within_budget(bundle: Path, finished: Mapping[str, Mapping[int, Completion]], budget: int) -> None:
    """No finished sibling of the cut (listed in its sidecar, or staged and read back from TQ) is longer than
    the completion budget (``generation.max_new_tokens``), which nothing would generate and training could
    not take: exit 3 naming the group and both lengths."""
    for group_id, siblings in finished.items():
        for index, completion in siblings.items():
            if len(completion.token_ids) > budget:
                raise BundleError(bundle, f"finished sibling {index} of group {group_id} holds "
                                          f"{len(completion.token_ids)} completion tokens, more than the "
                                          f"{budget} of generation.max_new_tokens")


def check_against_config(config: Config, state: ControllerState, verified: VerifiedBundle,
                         allow_config_change: bool) -> dict[str, tuple[object, object]]:
    """A verified bundle against this run's config, task and sampler, before a restore loads anything; returns
    how the reward set changed (``check_settings``)."""
    info, bundle = verified.info, verified.path

    def refuse(reason: str) -> None:
        raise BundleError(bundle, reason)

    reward_changes = check_settings(config, state.sampler.name, info, bundle, allow_config_change)
    check_holdings(config, verified)
    beyond = [gid for gid, e in verified.ledger.entries().items() if e.prompt_id >= state.order.num_prompts]
    if beyond:
        refuse(f"names prompts the task no longer has (task.path holds {state.order.num_prompts} prompts; "
               f"first: {beyond[:3]})")
    if state.sampler.supports_replay_checkpoint:
        # The sampler must be able to resume from its document beside this ledger (install re-checks it
        # and applies it); refused here, before the trainer or TQ is loaded.  A shadow restore ignores
        # the document: install re-derives the state from the step.
        try:
            state.sampler.check_state(verified.sidecar.sampler.state, DispatchView.of(verified.ledger, info.step))
        except SamplerStateError as exc:
            refuse(str(exc))
    return reward_changes


def check_settings(config: Config, sampler: str, info: TrainingInfo, bundle: Path,
                   allow_config_change: bool) -> dict[str, tuple[object, object]]:
    """The bundle's recorded settings against this run's config (``sampler``: its sampler's name).

    A changed fingerprinted setting refuses the bundle (unless ``allow_config_change``), naming every one
    with its old and new value; the reward set (``task.rewards``) is the exception: its changes are
    returned, (old, new) by key, for the restore to apply.
    """

    def refuse(reason: str) -> None:
        raise BundleError(bundle, reason)

    if info.sampler != sampler:
        refuse(f"was written with sampler {info.sampler!r}; this run uses {sampler!r}")
    if info.partition != config.data_plane.partition:
        refuse(f"holds TQ partition {info.partition!r}; this run uses {config.data_plane.partition!r}")
    changes = config.fingerprint_changes(info.config_fingerprint_fields)
    reward_changes = {key: change for key, change in changes.items() if is_reward_setting(key)}
    refused = {key: change for key, change in changes.items() if key not in reward_changes}
    if refused and not allow_config_change:
        listed = "".join(f"\n  {key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in refused.items())
        refuse(f"was written under settings that change what its rollouts or its sampler state mean, and this "
               f"config changes {len(refused)} of them (bundle -> config):{listed}\nSet them back to continue "
               "this run from the bundle; or pass --allow-config-change to restore it under the new values (a "
               "gated sampler's dispatch state is then re-derived from the ledger); or start a new run in "
               "another checkpointing.dir")
    saved_units = storage_units_of(info)
    if saved_units != config.data_plane.storage_units:
        # TQ refuses such a load only once it has begun, with a traceback; refused here, before it.
        refuse(f"holds a TQ snapshot of {saved_units} storage unit(s); data_plane.storage_units is "
               f"{config.data_plane.storage_units}, and TQ loads a snapshot only into as many units: set "
               f"data_plane.storage_units = {saved_units} to restore it")
    if info.group_size != config.generation.group_size:
        refuse(f"holds groups of {info.group_size}; generation.group_size is {config.generation.group_size}")
    return reward_changes


def _shown(value: object) -> str:
    return NOT_SET if value == NOT_SET else orjson.dumps(value).decode()


def check_holdings(config: Config, verified: VerifiedBundle) -> None:
    """What the bundle holds against the config's limits: buffer capacity, group size, completion budget."""
    info, bundle = verified.info, verified.path
    in_flight = len(verified.ledger.in_state(PromptState.IN_FLIGHT))
    # Only the configured limit refuses: beyond what the window can use, admission just waits while
    # the restored groups are trained (or evicted stale).
    limit = config.async_rl.buffer_capacity_groups
    if limit != "auto" and info.groups + in_flight > limit:
        raise BundleError(bundle, f"holds {info.groups} ready groups and {in_flight} prompts in flight, more than "
                                  f"async_rl.buffer_capacity_groups = {limit}")
    group_size = config.generation.group_size
    outside = [gid for gid, e in verified.ledger.entries().items() if any(i >= group_size for i, _ in e.staged)]
    if outside:
        raise BundleError(bundle, f"stages siblings beyond generation.group_size = {group_size} "
                                  f"(first: {outside[:3]})")
    check_finished_within_budget(bundle, verified.rollouts.finished, config.generation.max_new_tokens)


def newest_verifying(root: Path, below_step: int) -> Path | None:
    """The newest finalized bundle older than ``below_step`` that verifies, for an operator's hint."""
    for bundle in reversed(layout.finalized_bundles(root)):
        if (layout.step_of(bundle) or 0) >= below_step:
            continue
        try:
            verify_bundle(bundle)
        except BundleError:
            continue
        return bundle
    return None


def require_cursor_ahead_of_ledger(order: PromptOrder, ledger: PromptLedger, bundle: Path) -> None:
    """The dataloader cursor must be past every prompt the ledger holds, or prompts would be admitted twice."""
    epoch, cursor = order.state.epoch, order.state.cursor
    rank = order.ranks(epoch)
    for group_id, entry in ledger.entries().items():
        if entry.epoch > epoch:
            raise BundleError(bundle, f"dataloader cursor (epoch {epoch}) is behind prompt {group_id} of epoch "
                                      f"{entry.epoch}")
        if entry.epoch == epoch and rank[entry.prompt_id] >= cursor:
            raise BundleError(bundle, f"dataloader cursor {cursor} of epoch {epoch} is behind restored prompt "
                                      f"{group_id}: it would be admitted twice")
