"""Restoring a bundle, before any pump or ordinary data-plane operation (DESIGN §4).

Order: resolve -> verify offline (digests before TQ unpickles anything) ->
check against this run's config -> trainer -> dataloader -> TQ into a clean
data plane -> replay index (no tensor re-put) with exact inventory -> ledger and
cursor -> ``ControllerState.install``.  Any failure is an ``InvariantViolation``
(exit 3) naming the bundle.  What follows a restore (evicting stale groups,
syncing weights to generation) is the daemon's, with the state installed here.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import (
    BundleError,
    VerifiedBundle,
    legacy_replay_error,
    newest_verifying,
    storage_units_of,
    verify_bundle,
)
from scd.config import Config
from scd.dataloader import DataloaderState, PromptOrder
from scd.dataplane import DataPlane
from scd.errors import ConfigError, InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.replay import ReplayIndex, require_cut_inventory, require_exact_inventory
from scd.samplers import DispatchView, SamplerStateError
from scd.schema import RestorePhase, SchemaError, TrainingInfo, decode
from scd.state import ControllerState, Restored
from scd.training.grpo import GRPOTrainer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RestoreReport:
    bundle: Path
    step: int
    bundle_time: float  # wall-clock time of the bundle's cut
    groups_restored: int
    prompts_redispatched: int
    shadow: bool
    uncut_groups_cleared: int  # groups put while the bundle's TQ save ran: in its snapshot, not in its cut
    staged_siblings_not_loaded: int  # a shadow restore loads no TQ snapshot: its staged siblings run again
    phases: dict[str, float] = field(default_factory=dict)


def resolve_bundle(root: Path, restore_from: Path | None, discard_newer: bool = False) -> Path | None:
    """The bundle to restore: the operator's choice, else the newest finalized one; None for an empty start.

    Leftover ``*.tmp`` directories are removed here: they are never restored.  An operator's
    choice older than bundles in ``root`` is refused unless ``discard_newer`` (``keep_history_linear``).
    """
    for leftover in layout.leftover_tmp_dirs(root):
        log.warning("removing unfinished checkpoint %s", leftover)
        shutil.rmtree(leftover)
    if restore_from is not None:
        keep_history_linear(root, restore_from, discard_newer)
        return restore_from
    if root.is_dir():
        # Abandoned bundles are kept as they were and never restored: what they hold stops nothing.
        legacy = sorted(p for p in root.rglob(layout.LEGACY_REPLAY_FILE)
                        if p.relative_to(root).parts[0] != layout.ABANDONED_DIR)
        if legacy:
            raise legacy_replay_error(legacy[0])
    bundles = layout.finalized_bundles(root)
    return bundles[-1] if bundles else None


def newer_history(root: Path, restore_from: Path) -> list[Path]:
    """Finalized bundles in ``root`` that restoring ``restore_from`` would fork from: those at or past its
    step, other than itself.  The run continued from it would skip its checkpoints at their steps (a
    bundle is never overwritten), and a plain restart would resume them instead of it."""
    try:
        step = decode(restore_from / layout.TRAINING_INFO_FILE, TrainingInfo).step
    except (SchemaError, OSError):
        return []  # not a bundle scd can read: verification refuses it, naming why
    return [bundle for bundle in layout.finalized_bundles(root)
            if (layout.step_of(bundle) or 0) >= step and bundle.resolve() != restore_from.resolve()]


def keep_history_linear(root: Path, restore_from: Path | None, discard_newer: bool) -> None:
    """Refuse to restore ``restore_from`` while newer bundles exist in ``root``; with ``discard_newer``, move
    those to ``<root>/abandoned/<time>/`` instead, so the next plain restart resumes the run continued
    from ``restore_from``.

    A usage error (exit 2), not an invariant violation: every bundle is sound, the command line just
    has not said which history to continue.  The cli calls this before Ray starts.
    """
    newer = newer_history(root, restore_from) if restore_from is not None else []
    if not newer:
        return
    names = ", ".join(bundle.name for bundle in newer)
    if not discard_newer:
        raise ConfigError("--restore-from", (
            f"{root} holds finalized bundles at or past the step of {restore_from}: {names}. Continuing from "
            "it would fork the run: its checkpoints at those steps would be skipped (a bundle is never "
            "overwritten), and the next plain restart would resume the newer, abandoned history. Pass "
            f"--discard-newer to move them to {root / layout.ABANDONED_DIR}/<time>/ (kept, never deleted) and "
            "continue from it, or drop --restore-from to continue from the newest"))
    moved_to = abandon_bundles(root, newer)
    log.warning("--discard-newer: moved %s to %s; the run continues from %s", names, moved_to, restore_from)


def abandon_bundles(root: Path, bundles: list[Path]) -> Path:
    """Move ``bundles`` (oldest first) into a new ``<root>/abandoned/<UTC time>/``; returns it.

    Renames within ``root``, never a delete.  Oldest first: a crash part-way leaves the newest
    bundles in place, so a plain restart still resumes the old history's newest bundle and the
    same command finishes the move.
    """
    abandoned = root / layout.ABANDONED_DIR
    abandoned.mkdir(mode=layout.DIR_MODE, exist_ok=True)
    target = abandoned / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target.mkdir(mode=layout.DIR_MODE)
    for bundle in bundles:
        os.rename(bundle, target / bundle.name)
    layout.fsync_path(target)
    layout.fsync_path(root)
    remaining = layout.finalized_bundles(root)
    if remaining:
        layout.write_atomic(root / layout.LATEST, remaining[-1].name.encode())
    else:
        (root / layout.LATEST).unlink(missing_ok=True)
    return target


def verify_or_point_elsewhere(bundle: Path, explicit: bool) -> VerifiedBundle:
    """``verify_bundle``; a bundle that fails names the newest older one that verifies and how to restore it."""
    try:
        return verify_bundle(bundle)
    except BundleError as exc:
        raise BundleError(bundle, exc.reason + older_bundle_hint(bundle, explicit)) from None


def older_bundle_hint(bundle: Path, explicit: bool) -> str:
    """Where to go from a bundle that cannot be restored: the newest older bundle beside it that verifies,
    and the ``scd run`` flags that restore it (``--discard-newer`` when the newer ones would fork the run)."""
    fallback = newest_verifying(bundle.parent, layout.step_of(bundle) or 0)
    if fallback is None:
        return "; no older bundle verifies either"
    flags = f"--restore-from {fallback}" + (" --discard-newer" if newer_history(fallback.parent, fallback) else "")
    # Only a bundle the operator chose can have newer ones beside it that verify.
    which = "the newest bundle older than it that verifies" if explicit else "the newest bundle that verifies"
    return f"; {which} is {fallback}: restart with {flags}"


def check_against_config(config: Config, state: ControllerState, verified: VerifiedBundle,
                         allow_config_change: bool) -> None:
    info, bundle = verified.info, verified.path

    def refuse(reason: str) -> None:
        raise BundleError(bundle, reason)

    if info.sampler != state.sampler.name:
        refuse(f"was written with sampler {info.sampler!r}; this run uses {state.sampler.name!r}")
    if info.partition != config.data_plane.partition:
        refuse(f"holds TQ partition {info.partition!r}; this run uses {config.data_plane.partition!r}")
    in_flight = len(verified.ledger.in_state(PromptState.IN_FLIGHT))
    if info.groups + in_flight > config.async_rl.buffer_capacity_groups:
        refuse(f"holds {info.groups} ready groups and {in_flight} prompts in flight, more than "
               f"async_rl.buffer_capacity_groups = {config.async_rl.buffer_capacity_groups}")
    if info.config_fingerprint != config.fingerprint() and not allow_config_change:
        saved, now = info.config_fingerprint_fields, config.fingerprint_fields()
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        refuse(f"was written under other settings that change what its rollouts or its sampler state mean: "
               f"{changed}; pass --allow-config-change to restore anyway (a gated sampler's dispatch state is "
               "then re-derived from the ledger)")
    saved_units = storage_units_of(info)
    if saved_units != config.data_plane.storage_units:
        # TQ refuses such a load only once it has begun, with a traceback; refused here, before it.
        refuse(f"holds a TQ snapshot of {saved_units} storage unit(s); data_plane.storage_units is "
               f"{config.data_plane.storage_units}, and TQ loads a snapshot only into as many units: set "
               f"data_plane.storage_units = {saved_units} to restore it")
    if info.group_size != config.generation.group_size:
        refuse(f"holds groups of {info.group_size}; generation.group_size is {config.generation.group_size}")
    group_size = config.generation.group_size
    outside = [gid for gid, e in verified.ledger.entries().items() if any(i >= group_size for i, _ in e.staged)]
    if outside:
        refuse(f"stages siblings beyond generation.group_size = {group_size} (first: {outside[:3]})")
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


async def restore_state(config: Config, state: ControllerState, dataplane: DataPlane, trainer: GRPOTrainer,
                        restore_from: Path | None, allow_config_change: bool) -> RestoreReport | None:
    phases: dict[str, float] = {}
    uncut_cleared = 0
    started = clock = time.monotonic()

    def lap(phase: RestorePhase) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[phase] = phases.get(phase, 0.0) + now - clock
        clock = now

    root = Path(config.checkpointing.dir)
    bundle = resolve_bundle(root, restore_from)
    if bundle is None:
        log.info("no checkpoint in %s: starting empty", root)
        return None
    verified = verify_or_point_elsewhere(bundle, explicit=restore_from is not None)
    check_against_config(config, state, verified, allow_config_change)
    info, sidecar = verified.info, verified.sidecar
    shadow = not state.sampler.supports_replay_checkpoint
    lap(RestorePhase.RESOLVE)

    # Trainer: weights and optimizer, tensors only.
    trainer.model.load_state_dict(torch.load(bundle / layout.MODEL_FILE, weights_only=True))
    trainer.optimizer.load_state_dict(torch.load(bundle / layout.OPTIMIZER_FILE, weights_only=True))
    dl = verified.dataloader
    dataloader = DataloaderState(seed=dl.seed, epoch=dl.epoch, cursor=dl.cursor)
    require_cursor_ahead_of_ledger(PromptOrder(state.order.num_prompts, dataloader), verified.ledger, bundle)
    lap(RestorePhase.DATALOADER)

    if shadow:
        log.warning("sampler %s does not support replay recovery: its TQ snapshot was saved in shadow mode; "
                    "its %d ready groups are generated again", state.sampler.name, len(sidecar.groups))
    else:
        await load_into_clean_data_plane(dataplane, bundle)
    lap(RestorePhase.TQ)

    # The index verify_bundle rebuilt (each group checked, the digest matched): installed as it is.
    index = ReplayIndex() if shadow else verified.index
    staged = verified.ledger.staged_keys()
    if not shadow:
        faults.hit("during_restore_index")
        expected = index.keys() | staged
        uncut_cleared = await clear_uncut_groups(dataplane, expected, set(sidecar.uncut_keys), bundle)
    lap(RestorePhase.REPLAY_METADATA)

    staged_not_loaded = len(staged) if shadow else 0
    state.install(Restored(
        step=info.step, weight_version=info.weight_version, dataloader=dataloader, index=index,
        ledger=verified.ledger, sampler_state=sidecar.sampler.state, shadow=shadow,
    ))
    redispatched = len(state.ledger.in_state(PromptState.IN_FLIGHT))
    lap(RestorePhase.LEDGER)
    phases[RestorePhase.TOTAL] = time.monotonic() - started
    return RestoreReport(bundle, info.step, info.time, len(state.replay), redispatched, shadow, uncut_cleared,
                         staged_not_loaded, phases)


async def clear_uncut_groups(dataplane: DataPlane, expected: set[str], uncut: set[str], bundle: Path) -> int:
    """Exact inventory at restore: TQ ends up holding the cut's groups and staged siblings, no more, no fewer.

    The snapshot was taken while commits went on, so it may hold groups put after the
    cut; the bundle names each key that could be there, and they are cleared here
    (their prompts are in flight in the cut's ledger and are generated again).  Any
    other difference refuses the bundle.  Returns how many groups were cleared.
    """
    where = f"restore of {bundle}"
    listed = await dataplane.list_keys()
    require_cut_inventory(expected, listed, uncut, where)
    extra = sorted(listed - expected)
    if extra:
        log.info("restore of %s: clearing %d groups or staged siblings put while its TQ save ran", bundle,
                 len(extra))
        await dataplane.clear(extra)
        require_exact_inventory(expected, await dataplane.list_keys(), where)
    return len(extra)


async def load_into_clean_data_plane(dataplane: DataPlane, bundle: Path) -> None:
    """``tq.load_checkpoint`` replaces all of TQ's state, every partition's: refuse unless nothing has used
    this data plane and TQ holds no row at all, scd's or another user's of the same TQ."""
    if dataplane.data_ops:
        raise InvariantViolation(f"restore of {bundle}: the data plane already served {dataplane.data_ops} "
                                 "operations; TQ must be loaded before any data op")
    held = await dataplane.keys_per_partition()
    own = (dataplane.partition, dataplane.staging)
    present = sum(held.get(partition, 0) for partition in own)
    if present:
        raise InvariantViolation(f"restore of {bundle}: TQ partition {dataplane.partition!r} already holds "
                                 f"{present} groups; restore needs a clean data plane")
    others = {partition: n for partition, n in sorted(held.items()) if n and partition not in own}
    if others:
        listed = ", ".join(f"{partition!r} ({n} keys)" for partition, n in others.items())
        raise ConfigError("data_plane.ray.address", (
            f"the TransferQueue this run attached to holds partitions that are not this run's "
            f"({dataplane.partition!r} and {dataplane.staging!r}): {listed}. Restoring {bundle} loads TQ's "
            "snapshot, which replaces every partition and would wipe them; nothing was loaded. Restore into a "
            "TQ of its own (leave data_plane.ray.address empty for a private Ray, or join another cluster), "
            "or clear those partitions first if nobody needs them"))
    faults.hit("during_restore_tq_load")
    await dataplane.load_snapshot(bundle / layout.DATA_PLANE_DIR)


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
