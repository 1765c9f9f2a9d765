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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import BundleError, VerifiedBundle, legacy_replay_error, newest_verifying, verify_bundle
from scd.config import Config
from scd.dataloader import DataloaderState, PromptOrder
from scd.dataplane import DataPlane
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.replay import ReplayIndex, require_cut_inventory, require_exact_inventory
from scd.schema import RestorePhase
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


def resolve_bundle(root: Path, restore_from: Path | None) -> Path | None:
    """The bundle to restore: the operator's choice, else the newest finalized one; None for an empty start.

    Leftover ``*.tmp`` directories are removed here: they are never restored.
    """
    for leftover in layout.leftover_tmp_dirs(root):
        log.warning("removing unfinished checkpoint %s", leftover)
        shutil.rmtree(leftover)
    if restore_from is not None:
        return restore_from
    legacy = sorted(root.rglob(layout.LEGACY_REPLAY_FILE)) if root.is_dir() else []
    if legacy:
        raise legacy_replay_error(legacy[0])
    bundles = layout.finalized_bundles(root)
    return bundles[-1] if bundles else None


def verify_or_point_elsewhere(bundle: Path, explicit: bool) -> VerifiedBundle:
    try:
        return verify_bundle(bundle)
    except BundleError as exc:
        if explicit:
            raise
        fallback = newest_verifying(bundle.parent, layout.step_of(bundle) or 0)
        hint = (f"; the newest bundle that verifies is {fallback}: restart with --restore-from {fallback}"
                if fallback else "; no older bundle verifies either")
        raise BundleError(bundle, exc.reason + hint) from None


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
        refuse(f"was written under other settings that change what its rollouts mean: {changed}; "
               "pass --allow-config-change to restore anyway")
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
    """``tq.load_checkpoint`` replaces all of TQ's state: refuse unless nothing has used this data plane."""
    if dataplane.data_ops:
        raise InvariantViolation(f"restore of {bundle}: the data plane already served {dataplane.data_ops} "
                                 "operations; TQ must be loaded before any data op")
    present = await dataplane.list_keys()
    if present:
        raise InvariantViolation(f"restore of {bundle}: TQ partition {dataplane.partition!r} already holds "
                                 f"{len(present)} groups; restore needs a clean data plane")
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
