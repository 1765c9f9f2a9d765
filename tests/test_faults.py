"""Kill scd at every named fault point in turn; each next process restores the newest finalized bundle.

One chain of processes: each one restores what the previous one left, runs into the next fault point
and dies there (os._exit, like SIGKILL); the last one finishes its steps.  A restore that failed its
exact-inventory check would exit 3 and break the chain.
"""

from __future__ import annotations

from pathlib import Path

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from tests.conftest import ScdProcess, write_config

CHECKPOINTS = "\n[checkpointing]\nenabled = true\ninterval_s = 0.5\nkeep_last = 2\n"
FAULT_EXIT = 137

# Point and passage: the second checkpoint of a process dies, so it has finalized one bundle first;
# retention first deletes at the third bundle; restore points die at their first passage.  A
# post-cut commit is a put while a TQ save runs: the third one dies, so the bundle restored next may
# hold rows committed during its own save.
CHAIN = [
    "before_barrier:2", "in_exclusive_hold:2", "during_restore_tq_load:1", "post_cut_commit:3", "after_tq_save:2",
    "during_deferred_clear:2",
    "mid_sidecar_write:2", "during_restore_index:1", "before_finalize_rename:2",
    "after_finalize_before_latest:2", "during_retention:1",
]


def test_killed_at_every_fault_point_and_restored_each_time(
    tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str
) -> None:
    config = write_config(tmp_path, max_steps=100_000, extra=CHECKPOINTS, ray_address=session_ray)
    root = tmp_path / "out" / "checkpoints"
    outcomes = []
    for fault in CHAIN:
        before = layout.finalized_bundles(root)
        victim = ScdProcess(config, env={"SCD_FAULT": fault})
        scd_processes.append(victim)
        assert victim.wait(timeout=180) == FAULT_EXIT, (fault, victim.output()[-3000:])
        out = victim.output()
        assert f"SCD_FAULT: exiting at {fault.split(':')[0]}" in out
        if before and "restore" not in fault:
            assert f"restored {before[-1]}: step {layout.step_of(before[-1])}," in out, (fault, out[-3000:])
        after = layout.finalized_bundles(root)
        assert after, f"no finalized bundle survived {fault}"
        for bundle in after:
            verify_bundle(bundle)
        outcomes.append((fault, layout.step_of(after[-1])))

    newest = layout.finalized_bundles(root)[-1]
    k = layout.step_of(newest)
    assert k is not None
    survivor = ScdProcess(config, "--max-steps", str(k + 2))
    scd_processes.append(survivor)
    assert survivor.wait(timeout=180) == 0, survivor.output()[-3000:]
    assert f"restored {newest}: step {k}," in survivor.output()
    assert not layout.leftover_tmp_dirs(root)
    assert layout.step_of(layout.finalized_bundles(root)[-1]) == k + 2
    print("fault point -> newest finalized step after the kill:", outcomes)
