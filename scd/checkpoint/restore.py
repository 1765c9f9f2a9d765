"""Restoring a bundle, before any pump or ordinary data-plane operation: one path, start to end.

Order, one timed phase each (``RestorePhase``): resolve the bundle and check its
files' digests (before TQ unpickles anything) -> decode the replay metadata and
check it against this run's config -> load the policy -> the dataloader -> TQ
into a clean data plane -> the exact inventory -> ``ControllerState.install`` ->
read the in-window staged siblings back (older ones are unstaged) -> evict stale
groups -> the first weight sync -> requeue in-flight prompts for generation.
Then admission may start.  Any failed check is an ``InvariantViolation`` (exit
3) naming the bundle.  Restore records its own telemetry, as save does.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import (
    BundleError,
    VerifiedBundle,
    legacy_replay_error,
    newest_verifying,
    read_metadata,
    verify_files,
)
from scd.config import Config
from scd.dataloader import DataloaderState, PromptOrder
from scd.dataplane import DataPlane
from scd.errors import InvariantViolation
from scd.generation.base import GenerationBackend
from scd.ledger import PromptLedger, PromptState, staged_key
from scd.records import Completion
from scd.replay import ReplayIndex, require_cut_inventory, require_exact_inventory
from scd.rollouts import Rollouts
from scd.schema import RestorePhase
from scd.state import ControllerState, Restored
from scd.telemetry import metrics
from scd.telemetry.events import EventLog
from scd.training.grpo import GRPOTrainer

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestoreParts:
    """What a restore puts back or reads from: the controller's parts, never the controller."""

    state: ControllerState
    dataplane: DataPlane
    trainer: GRPOTrainer
    generation: GenerationBackend
    rollouts: Rollouts
    events: EventLog


@dataclass(frozen=True, slots=True)
class RestoreReport:
    bundle: Path
    step: int
    bundle_time: float  # wall-clock time of the bundle's cut
    groups_restored: int
    groups_evicted_stale: int
    prompts_redispatched: int
    shadow: bool
    uncut_groups_cleared: int  # groups put while the bundle's TQ save ran: in its snapshot, not in its cut
    siblings_reused: int
    siblings_rerun: int  # out of the staleness window, or not loaded (a shadow restore loads no TQ snapshot)
    phases: dict[str, float] = field(default_factory=dict)


class _PhaseClock:
    """Each lap is charged to one phase; ``total`` runs from the clock's start."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.phases: dict[str, float] = {}

    def lap(self, phase: RestorePhase) -> None:
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def stop(self) -> dict[str, float]:
        self.phases[RestorePhase.TOTAL] = time.monotonic() - self.started
        return self.phases


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


def verify_or_point_elsewhere(bundle: Path, explicit: bool, check: Callable[[], T]) -> T:
    """``check()``; a bundle that fails it names the newest older one that verifies (unless chosen by hand)."""
    try:
        return check()
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


async def restore_state(config: Config, parts: RestoreParts, restore_from: Path | None,
                        allow_config_change: bool) -> RestoreReport | None:
    """The newest finalized bundle (or ``restore_from``) put back, up to the first admission; None for
    an empty start."""
    state, dataplane = parts.state, parts.dataplane
    clock = _PhaseClock()
    root = Path(config.checkpointing.dir)
    bundle = resolve_bundle(root, restore_from)
    if bundle is None:
        log.info("no checkpoint in %s: starting empty", root)
        return None
    explicit = restore_from is not None
    info = verify_or_point_elsewhere(bundle, explicit, lambda: verify_files(bundle))
    clock.lap(RestorePhase.RESOLVE)
    verified = verify_or_point_elsewhere(bundle, explicit, lambda: read_metadata(bundle, info))
    check_against_config(config, state, verified, allow_config_change)
    sidecar = verified.sidecar
    shadow = not state.sampler.supports_replay_checkpoint
    clock.lap(RestorePhase.REPLAY_METADATA)

    parts.trainer.load_state(torch.load(bundle / layout.MODEL_FILE, weights_only=True),
                             torch.load(bundle / layout.OPTIMIZER_FILE, weights_only=True))
    clock.lap(RestorePhase.POLICY_LOAD)

    dl = verified.dataloader
    dataloader = DataloaderState(seed=dl.seed, epoch=dl.epoch, cursor=dl.cursor)
    require_cursor_ahead_of_ledger(PromptOrder(state.order.num_prompts, dataloader), verified.ledger, bundle)
    clock.lap(RestorePhase.DATALOADER)

    if shadow:
        log.warning("sampler %s does not support replay recovery: its TQ snapshot was saved in shadow mode; "
                    "its %d ready groups are generated again", state.sampler.name, len(sidecar.groups))
    else:
        await load_into_clean_data_plane(dataplane, bundle)
    clock.lap(RestorePhase.TQ)

    # The index read_metadata rebuilt (each group checked, the digest matched): installed as it is.
    index = ReplayIndex() if shadow else verified.index
    staged_in_bundle = verified.ledger.staged_keys()
    uncut_cleared = 0
    if not shadow:
        faults.hit("during_restore_index")
        uncut_cleared = await clear_uncut_groups(dataplane, index.keys() | staged_in_bundle,
                                                 set(sidecar.uncut_keys), bundle)
    clock.lap(RestorePhase.TQ_INVENTORY)

    state.install(Restored(
        step=info.step, weight_version=info.weight_version, dataloader=dataloader, index=index,
        ledger=verified.ledger, sampler_state=sidecar.sampler.state, shadow=shadow,
    ))
    clock.lap(RestorePhase.LEDGER)

    reused, rerun = await restore_staged_siblings(state, dataplane, parts.rollouts)
    rerun += len(staged_in_bundle) if shadow else 0
    clock.lap(RestorePhase.SIBLINGS)
    evicted = await parts.rollouts.evict_stale()
    clock.lap(RestorePhase.EVICT)
    await parts.generation.update_weights(parts.trainer.weights(), state.weight_version)
    clock.lap(RestorePhase.FIRST_WEIGHT_SYNC)
    redispatched = await parts.rollouts.requeue_in_flight()
    clock.lap(RestorePhase.REDISPATCH)

    report = RestoreReport(
        bundle=bundle, step=info.step, bundle_time=info.time, groups_restored=len(state.replay),
        groups_evicted_stale=evicted, prompts_redispatched=redispatched, shadow=shadow,
        uncut_groups_cleared=uncut_cleared, siblings_reused=reused, siblings_rerun=rerun, phases=clock.stop(),
    )
    await record_restore(report, parts.events)
    return report


async def restore_staged_siblings(state: ControllerState, dataplane: DataPlane,
                                  rollouts: Rollouts) -> tuple[int, int]:
    """The restored cut's staged siblings: those within the staleness window are read back and handed
    to ``rollouts`` (not generated again); older ones are unstaged, to be generated again.

    Returns (reused, rerun).
    """
    window_start = state.window_start()
    reusable: list[tuple[str, int, int]] = []
    rerun = 0
    for group_id in state.ledger.in_state(PromptState.IN_FLIGHT):
        staged = state.ledger.entry(group_id).staged
        stale = tuple((index, version) for index, version in staged if version < window_start)
        if stale:
            await state.unstage_siblings(group_id, stale)
            rerun += len(stale)
        reusable.extend((group_id, index, version) for index, version in staged if version >= window_start)
    read = await dataplane.get_siblings([staged_key(*sibling) for sibling in reusable])
    siblings: dict[str, dict[int, Completion]] = {}
    for (group_id, index, version), (token_ids, logprobs, finish) in zip(reusable, read, strict=True):
        siblings.setdefault(group_id, {})[index] = Completion(token_ids, logprobs, finish, version)
    rollouts.keep_restored(siblings)
    return len(reusable), rerun


async def record_restore(report: RestoreReport, events: EventLog) -> None:
    """The restore's outcome on /metrics, in the log and as a ``restore`` event."""
    for phase, seconds in report.phases.items():
        metrics.restore_phase.labels(phase).observe(seconds)
    metrics.recovery_siblings_reused.inc(report.siblings_reused)
    metrics.recovery_siblings_rerun.inc(report.siblings_rerun)
    metrics.recovery_groups_restored.set(report.groups_restored)
    metrics.recovery_groups_evicted_stale.set(report.groups_evicted_stale)
    metrics.recovery_prompts_redispatched.set(report.prompts_redispatched)
    log.info("restored %s: step %d, %d groups ready, %d evicted stale, %d prompts to redispatch, "
             "%d finished siblings reused, %d to generate again%s (%.2fs)",
             report.bundle, report.step, report.groups_restored, report.groups_evicted_stale,
             report.prompts_redispatched, report.siblings_reused, report.siblings_rerun,
             " [shadow: replay index not restored]" if report.shadow else "", report.phases[RestorePhase.TOTAL])
    await events.emit(
        "restore", report.step, bundle=str(report.bundle), phases=report.phases,
        groups_restored=report.groups_restored, groups_evicted_stale=report.groups_evicted_stale,
        prompts_redispatched=report.prompts_redispatched, shadow=report.shadow,
        uncut_groups_cleared=report.uncut_groups_cleared, siblings_reused=report.siblings_reused,
        siblings_rerun=report.siblings_rerun,
    )


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
