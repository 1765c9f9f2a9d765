"""Offline verification of a bundle: everything that can be checked without loading TQ.

``verify_bundle`` never unpickles anything: TQ's files are checked by SHA-256
against ``training_info.json`` (recorded right after the live exact-inventory
check), so a tampered ``data_plane/`` is rejected before TQ would load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson

from scd.checkpoint import layout
from scd.errors import InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.replay import GroupMeta, ReplayIndex


class BundleError(InvariantViolation):
    """A bundle that must not be restored, with the reason and the bundle's path."""

    def __init__(self, bundle: Path, reason: str) -> None:
        super().__init__(f"checkpoint {bundle}: {reason}")
        self.bundle = bundle
        self.reason = reason


@dataclass(slots=True)
class VerifiedBundle:
    path: Path
    info: dict[str, Any]
    sidecar: dict[str, Any]
    dataloader: dict[str, Any]
    groups: list[GroupMeta]
    ledger: PromptLedger


def legacy_replay_error(path: Path) -> BundleError:
    return BundleError(path.parent, f"holds a legacy tensor-bearing {layout.LEGACY_REPLAY_FILE}: scd keeps "
                                    "rollout tensors only in TQ's native snapshot. Start this run from a bundle "
                                    "written by scd (--restore-from), or move the legacy directory out of "
                                    "checkpointing.dir to start empty")


def _load_json(bundle: Path, name: str) -> dict[str, Any]:
    path = bundle / name
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise BundleError(bundle, f"{name} is missing") from None
    except orjson.JSONDecodeError as exc:
        raise BundleError(bundle, f"{name} is not valid JSON (truncated or corrupt): {exc}") from None
    if not isinstance(data, dict):
        raise BundleError(bundle, f"{name} is not a JSON object")
    if data.get("schema_version") != layout.SCHEMA_VERSION:
        raise BundleError(bundle, f"{name} has schema_version {data.get('schema_version')!r}; "
                                  f"this scd reads {layout.SCHEMA_VERSION}")
    return data


def _require(ok: bool, bundle: Path, reason: str) -> None:
    if not ok:
        raise BundleError(bundle, reason)


def verify_bundle(bundle: Path) -> VerifiedBundle:
    """Schema, file digests, sidecar digest and counts, ledger consistency; raises ``BundleError``."""
    _require(bundle.is_dir(), bundle, "is not a directory")
    if (bundle / layout.LEGACY_REPLAY_FILE).exists():
        raise legacy_replay_error(bundle / layout.LEGACY_REPLAY_FILE)
    _require(not bundle.name.endswith(".tmp"), bundle, "is an unfinished .tmp directory")
    marker = bundle / layout.COMMIT_MARKER
    _require(marker.is_file(), bundle, f"has no {layout.COMMIT_MARKER} marker: it was never finalized")
    info = _load_json(bundle, layout.TRAINING_INFO_FILE)
    _require(marker.read_bytes().decode(errors="replace") == layout.sha256_file(bundle / layout.TRAINING_INFO_FILE),
             bundle, f"{layout.TRAINING_INFO_FILE} does not match its commit marker (edited after finalize)")
    for key, kind in (("step", int), ("weight_version", int), ("epoch", int), ("groups", int), ("samples", int),
                      ("capacity", int), ("sampler", str), ("partition", str), ("replay_digest", str),
                      ("files", dict), ("config_fingerprint", str)):
        _require(isinstance(info.get(key), kind), bundle, f"{layout.TRAINING_INFO_FILE}: '{key}' missing or not "
                                                           f"{kind.__name__}")

    recorded: dict[str, str] = info["files"]
    present = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    present -= {layout.TRAINING_INFO_FILE, layout.COMMIT_MARKER}
    missing = sorted(set(recorded) - present)
    unexpected = sorted(present - set(recorded))
    _require(not missing, bundle, f"files missing: {missing[:10]}")
    _require(not unexpected, bundle, f"unexpected files (not written by scd): {unexpected[:10]}")
    for name, digest in recorded.items():
        _require(layout.sha256_file(bundle / name) == digest, bundle,
                 f"{name} does not match its SHA-256 in {layout.TRAINING_INFO_FILE} (corrupt or tampered)")

    sidecar = _load_json(bundle, layout.SIDECAR_FILE)
    dataloader = _load_json(bundle, layout.DATALOADER_FILE)
    try:
        groups = msgspec.convert(sidecar["groups"], list[GroupMeta])
        ledger = PromptLedger.from_json(sidecar["ledger"])
        sampler = sidecar["sampler"]
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise BundleError(bundle, f"{layout.SIDECAR_FILE} is malformed: {exc}") from None
    index = ReplayIndex()
    for group in groups:
        index.add(group)
    _require(sidecar.get("partition") == info["partition"], bundle, "sidecar and training_info name other partitions")
    _require(sampler.get("name") == info["sampler"], bundle, "sidecar and training_info name other samplers")
    _require(len(groups) == info["groups"], bundle,
             f"sidecar holds {len(groups)} groups, training_info says {info['groups']}")
    _require(index.rows == info["samples"], bundle,
             f"sidecar holds {index.rows} samples, training_info says {info['samples']}")
    digest = index.digest()
    _require(digest == info["replay_digest"] == sidecar.get("replay_digest"), bundle,
             f"replay digest mismatch: sidecar content {digest[:12]}, recorded {info['replay_digest'][:12]}")
    ready = set(ledger.in_state(PromptState.READY))
    _require(ready == {g.group_id for g in groups}, bundle,
             "ledger's ready prompts and the sidecar's groups differ")
    _require(dataloader.get("epoch") == info["epoch"], bundle, "dataloader epoch differs from training_info")
    for key in ("seed", "epoch", "cursor"):
        _require(isinstance(dataloader.get(key), int), bundle, f"{layout.DATALOADER_FILE}: '{key}' missing")
    return VerifiedBundle(bundle, info, sidecar, dataloader, groups, ledger)


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
