"""Read-only views of bundles for the ``scd checkpoint`` commands."""

from __future__ import annotations

from pathlib import Path

from scd.checkpoint import layout
from scd.checkpoint.verify import storage_units_of, verify_bundle
from scd.config import saved_training_settings
from scd.replay import mean_reward_components


def list_bundles(root: Path) -> list[dict[str, object]]:
    """Every step directory under ``root``, finalized or not, newest last."""
    latest = (root / layout.LATEST).read_text().strip() if (root / layout.LATEST).is_file() else None
    rows = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")):
        finalized = (path / layout.COMMIT_MARKER).is_file() and not path.name.endswith(".tmp")
        rows.append({"name": path.name, "finalized": finalized, "latest": path.name == latest,
                     "bytes": layout.dir_bytes(path)})
    return rows


def inspect_bundle(path: Path) -> dict[str, object]:
    """A verified bundle's summary; raises ``BundleError`` for one that does not verify."""
    verified = verify_bundle(path)
    info = verified.info
    return {
        "path": str(path), "step": info.step, "weight_version": info.weight_version, "epoch": info.epoch,
        "sampler": info.sampler, "supports_replay_checkpoint": info.supports_replay_checkpoint,
        "partition": info.partition, "storage_units": storage_units_of(info), "groups": info.groups,
        "samples": info.samples, "group_size": info.group_size, "ledger": verified.ledger.counts(),
        "sidecar_bytes": info.sidecar_bytes,
        "data_plane_bytes": info.data_plane_bytes, "digest": info.replay_digest, "capacity": info.capacity,
        "time": info.time, "config_fingerprint": info.config_fingerprint,
        "training_settings": saved_training_settings(info.training_settings),
        "run_id": info.run.run_id if info.run is not None else None, "prompt_fates": verified.sidecar.prompt_fates,
        "trigger": info.trigger, "crash_restores": info.run.crash_restores if info.run is not None else 0,
        "evaluated_steps": info.evaluated_steps,
        "prefixes_part_way": len(verified.sidecar.prefixes),
        "prefixes_finished": len(verified.sidecar.finished_siblings),
        "prefix_tokens": sum(len(p.token_ids) for p in verified.sidecar.prefixes)
        + sum(len(f.token_ids) for f in verified.sidecar.finished_siblings),
        # Finished siblings of in-flight groups (staged, or finished in the cut), and how many have their score.
        "siblings_finished": verified.ledger.staged_count() + len(verified.sidecar.finished_siblings),
        "siblings_scored": len(verified.sidecar.sibling_scores),
        "reward_components": mean_reward_components(verified.index.groups()),
    }

