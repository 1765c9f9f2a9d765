"""Kill scd at every named fault point; a fresh process restores the newest finalized bundle and goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from tests.conftest import ScdProcess, write_config

CHECKPOINTS = "\n[checkpointing]\nenabled = true\ninterval_s = 0.5\nkeep_last = 2\n"
FAULT_EXIT = 137

# Point and passage: the second checkpoint dies, so a first finalized bundle exists to come back to.
SAVE_POINTS = [
    "before_barrier:2", "in_exclusive_hold:2", "after_tq_save:2", "mid_sidecar_write:2",
    "before_finalize_rename:2", "after_finalize_before_latest:2", "during_retention:1",
]
RESTORE_POINTS = ["during_restore_tq_load:1", "during_restore_index:1"]


@pytest.mark.parametrize("fault", SAVE_POINTS + RESTORE_POINTS)
def test_killed_at_fault_point_then_restored(tmp_path: Path, scd_processes: list[ScdProcess], fault: str) -> None:
    config = write_config(tmp_path, max_steps=100_000, extra=CHECKPOINTS)
    root = tmp_path / "out" / "checkpoints"
    if fault in RESTORE_POINTS:
        healthy = ScdProcess(config, "--max-steps", "6")
        scd_processes.append(healthy)
        assert healthy.wait(timeout=180) == 0, healthy.output()[-3000:]
    victim = ScdProcess(config, env={"SCD_FAULT": fault})
    scd_processes.append(victim)
    assert victim.wait(timeout=180) == FAULT_EXIT, victim.output()[-3000:]
    assert f"SCD_FAULT: exiting at {fault.split(':')[0]}" in victim.output()
    victim.kill_group()  # the Ray processes the dead scd left behind

    bundles = layout.finalized_bundles(root)
    assert bundles, "no finalized bundle survived"
    newest = bundles[-1]
    k = layout.step_of(newest)
    assert k is not None
    survivor = ScdProcess(config, "--max-steps", str(k + 2))
    scd_processes.append(survivor)
    assert survivor.wait(timeout=180) == 0, survivor.output()[-3000:]
    assert f"restored {newest}: step {k}," in survivor.output()
    assert not layout.leftover_tmp_dirs(root)
    for bundle in layout.finalized_bundles(root):
        verify_bundle(bundle)
    assert layout.step_of(layout.finalized_bundles(root)[-1]) == k + 2
