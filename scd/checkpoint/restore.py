"""Restoring a bundle, before any pump or ordinary data-plane operation: one path, start to end.

Order, one timed phase each (``RestorePhase``): resolve the bundle and check its
files' digests (before TQ unpickles anything) -> decode the replay metadata and
check it against this run's config -> the dataloader's cursor against the
ledger -> TQ must be clean -> load the policy -> TQ's snapshot -> the exact
inventory -> ``ControllerState.install`` -> read the staged siblings back and
hand them, with the bundle's own, to ``Rollouts.restore`` -> evict stale groups -> under a changed reward
set, score the ready groups again (``rescore_ready_groups``) -> the first weight sync ->
requeue in-flight prompts for generation.  Then admission may start.  Every
refusal comes before the trainer or TQ is loaded, except the inventory check,
which needs TQ's snapshot; those for a changed config (``check_before_start``)
come before Ray, TQ or an engine even starts.  A bundle that fails a check is an
``InvariantViolation`` (exit 3) naming it and the newest older bundle that
verifies; TQ holding another run's partitions and an older ``--restore-from``
without ``--discard-newer`` are usage errors (exit 2).  Restore records its own
telemetry, as save does.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import anyio
import msgspec

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import (
    BundleError,
    check_against_config,
    check_finished_within_budget,
    check_holdings,
    check_settings,
    legacy_replay_error,
    newest_verifying,
    read_metadata,
    require_cursor_ahead_of_ledger,
    require_digest,
    verify_files,
)
from scd.config import Config
from scd.dataloader import DataloaderState, PromptOrder
from scd.dataplane import DataPlane
from scd.errors import ConfigError, InvariantViolation
from scd.generation.base import GenerationBackend
from scd.ledger import PromptState, staged_key
from scd.records import Completion
from scd.replay import ReplayIndex, require_cut_inventory, require_exact_inventory
from scd.rollouts import Rollouts
from scd.schema import RestorePhase, RunIdentity, SchemaError, TrainingInfo, Trigger, decode
from scd.state import ControllerState, Restored
from scd.telemetry import metrics
from scd.telemetry.eval_reports import report_evals, unreported
from scd.telemetry.events import EventLog, Restore
from scd.training.base import Trainer

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestoreParts:
    """What a restore puts back or reads from: the controller's parts, never the controller."""

    state: ControllerState
    dataplane: DataPlane
    trainer: Trainer
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
    # Completion tokens of restored groups evicted stale and of staged siblings out of the window: what
    # the restart threw away of work already generated (a shadow restore's siblings are not read: not counted).
    stale_tokens: int
    # The bundle's own siblings (``RolloutsRestored``): tokens taken up (resumed, or finished) and thrown
    # away (out of the window, too long, or a backend that cannot resume); siblings resumed.
    prefix_tokens_reused: int = 0
    prefix_tokens_dropped: int = 0
    siblings_resumed: int = 0
    scores_reused: int = 0  # finished siblings kept with their score: never scored again
    scores_owed: int = 0  # finished siblings kept without one: scored by this run, not generated again
    # Optimizer settings the config changed from the bundle's, [old, new] by key: the config's apply.
    optimizer_changes: dict[str, list[float]] = field(default_factory=dict)
    # Likewise the loss, the lr schedule and dynamic sampling (``Config.training_settings``).
    training_changes: dict[str, list[object]] = field(default_factory=dict)
    # The reward set's settings the config changed from the bundle's, [old, new] by key: the config's apply,
    # and the ready groups restored are scored again under them (the cut's sibling scores are owed again).
    reward_changes: dict[str, list[object]] = field(default_factory=dict)
    groups_rescored: int = 0
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


def resolve_bundle(root: Path, restore_from: Path | None, discard_newer: bool = False) -> Path | None:
    """The bundle to restore: the operator's choice, else the newest finalized one; None for an empty start.

    A replacement of a bundle a crash interrupted is completed, and leftover ``*.tmp`` directories are
    removed here: they are never restored.  An operator's
    choice older than bundles in ``root`` is refused unless ``discard_newer`` (``keep_history_linear``).
    """
    layout.finish_replacements(root)
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


def check_before_start(config: Config, sampler: str, restore_from: Path | None, discard_newer: bool,
                       allow_config_change: bool) -> None:
    """The bundle the restore will take (``resolve_bundle``: the operator's choice, or the newest) against the
    config, before Ray, TQ or an engine starts: the settings it was written under (``check_settings``:
    every changed one named, old and new) and what it holds against the config's limits (``check_holdings``);
    ``sampler`` is the run's sampler's name.  Which history the run continues (``--restore-from``,
    ``--discard-newer``) is settled here too.  Files' digests are left to the restore: a bundle this cannot
    decode is refused there, naming the newest older one that verifies."""
    if not config.checkpointing.enabled and restore_from is None:
        return
    bundle = resolve_bundle(Path(config.checkpointing.dir), restore_from, discard_newer)
    if bundle is None:
        return
    try:
        info = decode(bundle / layout.TRAINING_INFO_FILE, TrainingInfo)
    except SchemaError:
        return
    check_settings(config, sampler, info, bundle, allow_config_change)
    try:
        held = read_metadata(bundle, info)
    except BundleError:
        return
    check_holdings(config, held)


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
    has not said which history to continue.  The cli calls this (``check_before_start``) before Ray starts.
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


async def verify_or_point_elsewhere(bundle: Path, explicit: bool, check: Callable[[], T]) -> T:
    """``check()``, in a worker thread: it reads and hashes a bundle's files, seconds on a large bundle that
    the event loop (signals, ``/healthz``) must not wait out.  A bundle that fails it names the newest
    older one that verifies (unless chosen by hand)."""

    def checked() -> T:
        try:
            return check()
        except BundleError as exc:
            raise BundleError(bundle, exc.reason + older_bundle_hint(bundle, explicit)) from None

    return await anyio.to_thread.run_sync(checked)


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


# The trainer state is most of a bundle's bytes: its files are hashed while the trainer reads them (one of
# the two reads then comes from the page cache), not in a pass of their own before it.
POLICY_FILES = (layout.MODEL_FILE, layout.OPTIMIZER_FILE)


def load_trainer_state_verified(trainer: Trainer, bundle: Path, info: TrainingInfo) -> dict[str, list[float]]:
    """``trainer.load_state_files`` of the bundle's trainer state while its files' BLAKE3 digests are computed
    beside it; blocking.  A mismatch is a ``BundleError``, also where it made the load itself fail, raised
    before TQ loads anything; the trainer's state is then undefined, and the run ends."""
    with ThreadPoolExecutor(len(POLICY_FILES), thread_name_prefix="scd-restore-digest") as pool:
        digests = {name: pool.submit(layout.file_digest, bundle / name) for name in POLICY_FILES}
        try:
            return trainer.load_state_files(bundle / layout.MODEL_FILE, bundle / layout.OPTIMIZER_FILE)
        finally:
            for name, digest in digests.items():
                require_digest(bundle, name, digest.result(), info.files[name])


def log_changes(changes: Mapping[str, Sequence[object]], bundle: Path) -> None:
    """A warning for each setting the config changed from the bundle's, (old, new) by key."""
    for key, (old, new) in changes.items():
        log.warning("restore: %s is %s in the config, %s in %s: the config's applies from now on", key, new, old,
                    bundle)


def clean_exit(info: TrainingInfo) -> bool:
    """The bundle is the last a run wrote as it exited cleanly (done, or drained)."""
    return info.trigger in (Trigger.FINAL.value, Trigger.SHUTDOWN.value)


def after_a_crash(info: TrainingInfo) -> RunIdentity:
    """The bundle's run, a crash restart counted unless the bundle is a clean exit's (its last)."""
    assert info.run is not None
    if clean_exit(info):
        return info.run
    return msgspec.structs.replace(info.run, crash_restores=info.run.crash_restores + 1)


async def restore_state(config: Config, parts: RestoreParts, restore_from: Path | None,
                        allow_config_change: bool, discard_newer: bool = False) -> RestoreReport | None:
    """The newest finalized bundle (or ``restore_from``) put back, up to the first admission; None for
    an empty start."""
    state, dataplane = parts.state, parts.dataplane
    clock = _PhaseClock()
    root = Path(config.checkpointing.dir)
    bundle = resolve_bundle(root, restore_from, discard_newer)
    if bundle is None:
        log.info("no checkpoint in %s: starting empty", root)
        return None
    explicit = restore_from is not None
    info = await verify_or_point_elsewhere(bundle, explicit,
                                           lambda: verify_files(bundle, hashed_while_read=POLICY_FILES))
    clock.lap(RestorePhase.RESOLVE)
    verified = await verify_or_point_elsewhere(bundle, explicit, lambda: read_metadata(bundle, info))
    reward_changes = check_against_config(config, state, verified, allow_config_change)
    # Nothing to apply: the trainer, the schedule and admission read them from the config.
    training_changes = config.training_changes(info.training_settings)
    log_changes(training_changes, bundle)
    sidecar = verified.sidecar
    shadow = not state.sampler.supports_replay_checkpoint
    buckets = state.fates.buckets
    if sidecar.prompt_fates and set(sidecar.prompt_fates) != set(buckets.labels):
        log.warning("%s counted prompt fates in buckets %s; this run buckets by %s into %s: only the buckets "
                    "both have continue their counts", bundle, sorted(sidecar.prompt_fates), buckets.basis,
                    list(buckets.labels))
    clock.lap(RestorePhase.REPLAY_METADATA)

    dl = verified.dataloader
    dataloader = DataloaderState(seed=dl.seed, epoch=dl.epoch, cursor=dl.cursor)
    await verify_or_point_elsewhere(bundle, explicit, lambda: require_cursor_ahead_of_ledger(
        PromptOrder(state.order.num_prompts, dataloader), verified.ledger, bundle))
    clock.lap(RestorePhase.DATALOADER)
    # Every refusal comes before anything is loaded into TQ, and all but a trainer state file's digest before
    # the trainer loads: TQ stays as it was.
    if not shadow:
        await require_clean_data_plane(dataplane, bundle)
    clock.lap(RestorePhase.TQ)

    optimizer_changes = await verify_or_point_elsewhere(
        bundle, explicit, lambda: load_trainer_state_verified(parts.trainer, bundle, info))
    log_changes(optimizer_changes, bundle)
    clock.lap(RestorePhase.POLICY_LOAD)

    if shadow:
        log.warning("sampler %s does not support replay recovery: its TQ snapshot was saved in shadow mode; "
                    "its %d ready groups are generated again", state.sampler.name, len(sidecar.groups))
    else:
        faults.hit("during_restore_tq_load")
        await dataplane.load_snapshot(bundle / layout.DATA_PLANE_DIR)
    clock.lap(RestorePhase.TQ)

    # The index read_metadata rebuilt (each group checked, the digest matched): installed as it is.
    index = ReplayIndex() if shadow else verified.index
    staged_in_bundle = verified.ledger.staged_keys()
    uncut_cleared = 0
    if not shadow:
        faults.hit("during_restore_index")
        try:
            uncut_cleared = await clear_uncut_groups(dataplane, index.keys() | staged_in_bundle,
                                                     set(sidecar.uncut_keys), bundle)
        except InvariantViolation as exc:
            raise BundleError(bundle, f"{exc}{older_bundle_hint(bundle, explicit)}") from None
    clock.lap(RestorePhase.TQ_INVENTORY)

    state.install(Restored(
        step=info.step, weight_version=info.weight_version, dataloader=dataloader, index=index,
        ledger=verified.ledger, sampler_state=sidecar.sampler.state, shadow=shadow, fates=sidecar.prompt_fates,
        run=after_a_crash(info) if info.run is not None else None, after_crash=not clean_exit(info),
        evaluated_steps=info.evaluated_steps, held_evals=info.held_evals,
    ))
    clock.lap(RestorePhase.LEDGER)

    staged = await read_staged_siblings(state, dataplane)
    check_finished_within_budget(bundle, staged, config.generation.max_new_tokens)
    for key, (old, new) in reward_changes.items():
        log.warning("restore: %s is %s in the config, %s in %s: the config's rewards apply from now on, and the "
                    "scores the bundle holds are scored again under them", key, new, old, bundle)
    # Before the rescore below asks them: past step 0 a reward the restore did not move to another URL answered
    # in an earlier process, and an outage of its service at this start is waited out, not refused.
    answered = parts.rollouts.scoring.resumed(info.step, reward_changes.keys())
    if answered:
        log.info("restore: rewards %s answered before this process: an outage of theirs is waited out, not "
                 "refused after task.reward_start_timeout_s", answered)
    # Scores under the bundle's rewards are not kept: its finished siblings are owed a score under this run's.
    cut = replace(verified.rollouts, scores={}) if reward_changes else verified.rollouts
    siblings = await parts.rollouts.restore(cut, staged, resumable=parts.generation.resumable, shadow=shadow)
    clock.lap(RestorePhase.SIBLINGS)
    evicted = await parts.rollouts.evict_stale(at_restore=True)
    stale_tokens = siblings.stale_tokens + sum(group.completion_tokens for group in evicted)
    clock.lap(RestorePhase.EVICT)
    rescored = await rescore_ready_groups(state, dataplane, parts.rollouts) if reward_changes else 0
    clock.lap(RestorePhase.RESCORE)
    await parts.generation.update_weights(parts.trainer.live_weights(), state.weight_version)
    clock.lap(RestorePhase.FIRST_WEIGHT_SYNC)
    redispatched = await parts.rollouts.requeue_in_flight()
    clock.lap(RestorePhase.REDISPATCH)

    report = RestoreReport(
        bundle=bundle, step=info.step, bundle_time=info.time, groups_restored=len(state.replay),
        groups_evicted_stale=len(evicted), prompts_redispatched=redispatched, shadow=shadow,
        uncut_groups_cleared=uncut_cleared, siblings_reused=siblings.siblings_reused,
        # A shadow restore loaded no TQ snapshot: every sibling the bundle staged is generated again.
        siblings_rerun=siblings.siblings_rerun + (len(staged_in_bundle) if shadow else 0),
        stale_tokens=stale_tokens, prefix_tokens_reused=siblings.prefix_tokens_reused,
        prefix_tokens_dropped=siblings.prefix_tokens_dropped, siblings_resumed=siblings.siblings_resumed,
        scores_reused=siblings.scores_reused, scores_owed=siblings.scores_owed,
        optimizer_changes=optimizer_changes, phases=clock.stop(),
        training_changes={key: list(change) for key, change in training_changes.items()},
        reward_changes={key: list(change) for key, change in reward_changes.items()}, groups_rescored=rescored,
    )
    await record_restore(report, parts.events)
    # Of the evaluations the bundle holds, those the event log lacks (a crash came between its commit and
    # their report) are reported now; none is held on: each is reported once.
    owed = await anyio.to_thread.run_sync(unreported, state.held_evals, parts.events.path, info.time)
    await report_evals(owed, parts.events)
    state.evals_reported([record["step"] for record in state.held_evals])
    return report


# Ready groups read from TQ and scored again at once: bounds the rows a restore holds in memory.
RESCORE_GROUPS = 64


async def rescore_ready_groups(state: ControllerState, dataplane: DataPlane, rollouts: Rollouts) -> int:
    """Every ready group restored, scored again with this run's rewards (a changed reward set): no group scored
    under the bundle's rewards is trained after the restore.  Returns how many groups."""
    groups = state.replay.groups()
    for start in range(0, len(groups), RESCORE_GROUPS):
        chunk = groups[start:start + RESCORE_GROUPS]
        await state.replace_ready_groups(
            await rollouts.rescore(chunk, await dataplane.get_groups([g.group_id for g in chunk])))
    return len(groups)


async def read_staged_siblings(state: ControllerState, dataplane: DataPlane) -> dict[str, dict[int, Completion]]:
    """The restored cut's staged siblings read back from TQ in one get, by group id and sibling index; those
    out of the staleness window too (their tokens are what ``Rollouts.restore`` throws away)."""
    staged = [(group_id, index, version) for group_id in state.ledger.in_state(PromptState.IN_FLIGHT)
              for index, version in state.ledger.entry(group_id).staged]
    read = await dataplane.get_siblings([staged_key(*sibling) for sibling in staged])
    siblings: dict[str, dict[int, Completion]] = {}
    for (group_id, index, version), (token_ids, logprobs, finish) in zip(staged, read, strict=True):
        siblings.setdefault(group_id, {})[index] = Completion(token_ids, logprobs, finish, version)
    return siblings


async def record_restore(report: RestoreReport, events: EventLog) -> None:
    """The restore's outcome on /metrics, in the log and as a ``restore`` event."""
    for phase, seconds in report.phases.items():
        metrics.restore_phase.labels(phase).observe(seconds)
    metrics.recovery_siblings_reused.inc(report.siblings_reused)
    metrics.recovery_prefix_tokens_reused.inc(report.prefix_tokens_reused)
    metrics.recovery_prefix_tokens_dropped.inc(report.prefix_tokens_dropped)
    metrics.recovery_siblings_rerun.inc(report.siblings_rerun)
    metrics.recovery_groups_restored.set(report.groups_restored)
    metrics.recovery_groups_evicted_stale.set(report.groups_evicted_stale)
    metrics.recovery_prompts_redispatched.set(report.prompts_redispatched)
    metrics.recovery_stale_tokens.set(report.stale_tokens)
    log.info("restored %s: step %d, %d groups ready, %d evicted stale, %d prompts to redispatch, "
             "%d finished siblings reused, %d to generate again, %d stale tokens thrown away, %d siblings resumed "
             "(%d prefix tokens reused, %d dropped), %d scores kept, %d owed%s (%.2fs)",
             report.bundle, report.step, report.groups_restored, report.groups_evicted_stale,
             report.prompts_redispatched, report.siblings_reused, report.siblings_rerun, report.stale_tokens,
             report.siblings_resumed, report.prefix_tokens_reused, report.prefix_tokens_dropped,
             report.scores_reused, report.scores_owed,
             " [shadow: replay index not restored]" if report.shadow else "", report.phases[RestorePhase.TOTAL])
    await events.emit(Restore(
        step=report.step, bundle=str(report.bundle), phases=report.phases,
        groups_restored=report.groups_restored, groups_evicted_stale=report.groups_evicted_stale,
        prompts_redispatched=report.prompts_redispatched, shadow=report.shadow,
        uncut_groups_cleared=report.uncut_groups_cleared, siblings_reused=report.siblings_reused,
        siblings_rerun=report.siblings_rerun, stale_tokens=report.stale_tokens,
        prefix_tokens_reused=report.prefix_tokens_reused, prefix_tokens_dropped=report.prefix_tokens_dropped,
        siblings_resumed=report.siblings_resumed, scores_reused=report.scores_reused, scores_owed=report.scores_owed,
        optimizer_changes=report.optimizer_changes, training_changes=report.training_changes,
        reward_changes=report.reward_changes, groups_rescored=report.groups_rescored,
    ))


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


async def require_clean_data_plane(dataplane: DataPlane, bundle: Path) -> None:
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
