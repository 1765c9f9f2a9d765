"""Restoring a bundle, before any pump or ordinary data-plane operation (DESIGN §4).

Order: resolve -> verify offline (digests before TQ unpickles anything) ->
check against this run's config -> trainer -> dataloader -> TQ into a clean
data plane -> replay index (no tensor re-put) with exact inventory -> ledger and
cursor -> requeue in-flight prompts -> evict stale groups through the sampler ->
sync weights.  Any failure is an ``InvariantViolation`` (exit 3) naming the bundle.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scd import faults
from scd.checkpoint import layout
from scd.checkpoint.verify import BundleError, VerifiedBundle, legacy_replay_error, newest_verifying, verify_bundle
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.replay import require_exact_inventory

if TYPE_CHECKING:
    from scd.daemon import Controller

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RestoreReport:
    bundle: Path
    step: int
    groups_restored: int
    groups_evicted_stale: int
    prompts_redispatched: int
    shadow: bool
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


def check_against_config(controller: Controller, verified: VerifiedBundle, allow_config_change: bool) -> None:
    info, bundle = verified.info, verified.path
    config = controller.config

    def refuse(reason: str) -> None:
        raise BundleError(bundle, reason)

    if info["sampler"] != controller.sampler.name:
        refuse(f"was written with sampler {info['sampler']!r}; this run uses {controller.sampler.name!r}")
    if info["partition"] != controller.dataplane.partition:
        refuse(f"holds TQ partition {info['partition']!r}; this run uses {controller.dataplane.partition!r}")
    in_flight = len(verified.ledger.in_state(PromptState.IN_FLIGHT))
    if info["groups"] + in_flight > config.async_rl.buffer_capacity_groups:
        refuse(f"holds {info['groups']} ready groups and {in_flight} prompts in flight, more than "
               f"async_rl.buffer_capacity_groups = {config.async_rl.buffer_capacity_groups}")
    if info["config_fingerprint"] != config.fingerprint() and not allow_config_change:
        saved = info.get("config_fingerprint_fields", {})
        now = config.fingerprint_fields()
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        refuse(f"was written under other settings that change what its rollouts mean: {changed}; "
               "pass --allow-config-change to restore anyway")


async def restore_controller(controller: Controller, restore_from: Path | None,
                             allow_config_change: bool) -> RestoreReport | None:
    phases: dict[str, float] = {}
    started = clock = time.monotonic()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[phase] = phases.get(phase, 0.0) + now - clock
        clock = now

    root = Path(controller.config.checkpointing.dir)
    bundle = resolve_bundle(root, restore_from)
    if bundle is None:
        log.info("no checkpoint in %s: starting empty", root)
        return None
    verified = verify_or_point_elsewhere(bundle, explicit=restore_from is not None)
    check_against_config(controller, verified, allow_config_change)
    info = verified.info
    shadow = not controller.sampler.supports_replay_checkpoint
    lap("resolve")

    # Trainer: weights and optimizer, tensors only.
    trainer = controller.trainer
    trainer.model.load_state_dict(torch.load(bundle / layout.MODEL_FILE, weights_only=True))
    trainer.optimizer.load_state_dict(torch.load(bundle / layout.OPTIMIZER_FILE, weights_only=True))
    controller.trainer_step = info["step"]
    controller.weight_version = info["weight_version"]

    dl = verified.dataloader
    controller.order.restore(dl["seed"], dl["epoch"], dl["cursor"])
    lap("dataloader")

    ledger = verified.ledger
    if shadow:
        log.warning("sampler %s does not support replay recovery: its TQ snapshot was saved in shadow mode; "
                    "its %d ready groups are generated again", controller.sampler.name, len(verified.groups))
    else:
        await load_into_clean_data_plane(controller, bundle)
    lap("tq")

    if not shadow:
        for group in verified.groups:
            controller.replay.add(group)
            faults.hit("during_restore_index")
        if controller.replay.digest() != info["replay_digest"]:
            raise BundleError(bundle, "rebuilt replay index does not match the recorded digest")
        require_exact_inventory(controller.replay.sample_ids(), await controller.dataplane.list_ids(),
                                f"restore of {bundle}")
        controller.sampler.load_state(verified.sidecar["sampler"]["state"])
    lap("replay_metadata")

    require_cursor_ahead_of_ledger(controller, ledger, bundle)
    if shadow:
        for group in verified.groups:
            ledger.requeue_after_shadow_restore(group.group_id)
        # Gated samplers: quotas restart at the restored step; requeued prompts get fresh targets.
        controller.sampler.load_state({"dispatched": controller.trainer_step * controller.sampler.groups_per_step})
        for group_id in ledger.in_state(PromptState.IN_FLIGHT):
            ledger.entry(group_id).target_step = controller.sampler.on_dispatch()
    controller.ledger = ledger
    redispatched = len(ledger.in_state(PromptState.IN_FLIGHT))
    lap("ledger")

    evicted = await controller.evict_stale()
    await controller.backend.update_weights(trainer.weights(), controller.weight_version)
    phases["total"] = time.monotonic() - started
    return RestoreReport(bundle, info["step"], len(controller.replay), evicted, redispatched, shadow, phases)


async def load_into_clean_data_plane(controller: Controller, bundle: Path) -> None:
    """``tq.load_checkpoint`` replaces all of TQ's state: refuse unless nothing has used this data plane."""
    dataplane = controller.dataplane
    if dataplane.data_ops:
        raise InvariantViolation(f"restore of {bundle}: the data plane already served {dataplane.data_ops} "
                                 "operations; TQ must be loaded before any data op")
    present = await dataplane.list_ids()
    if present:
        raise InvariantViolation(f"restore of {bundle}: TQ partition {dataplane.partition!r} already holds "
                                 f"{len(present)} rows; restore needs a clean data plane")
    faults.hit("during_restore_tq_load")
    await dataplane.load_snapshot(bundle / layout.DATA_PLANE_DIR)


def require_cursor_ahead_of_ledger(controller: Controller, ledger: PromptLedger, bundle: Path) -> None:
    """The dataloader cursor must be past every prompt the ledger holds, or prompts would be admitted twice."""
    epoch, cursor = controller.order.state.epoch, controller.order.state.cursor
    rank = controller.order.ranks(epoch)
    for group_id, entry in ledger.entries().items():
        if entry.epoch > epoch:
            raise BundleError(bundle, f"dataloader cursor (epoch {epoch}) is behind prompt {group_id} of epoch "
                                      f"{entry.epoch}")
        if entry.epoch == epoch and rank[entry.prompt_id] >= cursor:
            raise BundleError(bundle, f"dataloader cursor {cursor} of epoch {epoch} is behind restored prompt "
                                      f"{group_id}: it would be admitted twice")
