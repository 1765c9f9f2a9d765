"""A gated sampler's dispatch state across a restart, on the session's real TQ and real runs.

A run of each gated sampler (groups_per_step 2) leaves its final bundle; each test copies it and
restarts from it: with another ``trainer.groups_per_step`` (refused without
``--allow-config-change``; re-derived with it, and then the run must reach its steps), or with a
sampler document edited the way a bug or an operator would (refused, naming the field).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
import pytest_asyncio

from scd.checkpoint import layout
from scd.checkpoint.verify import BundleError, verify_bundle
from scd.daemon import Controller
from tests.conftest import tiny_config
from tests.support.bundles import edit_json
from tests.support.tq import clear_partition

PARTITION = "sampler-restore"
FIRST_STEPS = 3
RUN_S = 120  # bound on a run: a stalled sampler fails the test instead of hanging the session


def config_for(root: Path, sampler: str, groups_per_step: int) -> Any:
    return tiny_config(root.parent, PARTITION, trainer={"groups_per_step": groups_per_step},
                       task={"size": 64}, async_rl={"buffer_capacity_groups": 16,
                                                    "sampler": {"name": sampler, "max_staleness_versions": 1}},
                       checkpointing={"enabled": True, "dir": str(root), "interval_s": 3600, "keep_last": 3})


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bundles(tq_session: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per gated sampler, the checkpoint root of a run of FIRST_STEPS steps at groups_per_step 2."""
    roots: dict[str, Path] = {}
    for sampler in ("in_order", "weight_fifo"):
        root = tmp_path_factory.mktemp(sampler) / "checkpoints"
        await clear_partition(PARTITION)
        async with Controller.open(config_for(root, sampler, 2)) as controller:
            with anyio.fail_after(RUN_S):
                await controller.run(max_steps=FIRST_STEPS)
        await clear_partition(PARTITION)
        bundle = layout.finalized_bundles(root)[-1]
        in_flight_or_ready = [e for e in verify_bundle(bundle).ledger.entries().values()
                              if e.state in ("in_flight", "ready")]
        assert layout.step_of(bundle) == FIRST_STEPS and in_flight_or_ready, "the cut must hold dispatched work"
        roots[sampler] = root
    return roots


def copy_root(bundles: dict[str, Path], sampler: str, tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(bundles[sampler], root)
    return root


def trained_after(events_path: str, step: int) -> list[list[list[int]]]:
    """The prompt ids of every train step after ``step``, in order."""
    events = [orjson.loads(line) for line in Path(events_path).read_bytes().splitlines()]
    return [e["prompt_ids"] for e in events if e["event"] == "train_step" and e["step"] > step]


# in_order 2 -> 4: its step 3 holds 2 groups and waits for 4; 2 -> 1: step 3 holds 2 and takes exactly 1.
# weight_fifo 2 -> 1: its quota is 2 per step ahead, so after the groups in flight are trained it
# never dispatches again.  Each stalled for ever before the fix, /healthz ok.
@pytest.mark.parametrize(("sampler", "groups_per_step", "more_steps"),
                         [("in_order", 4, 3), ("in_order", 1, 5), ("weight_fifo", 1, 5)],
                         ids=["in_order 2->4", "in_order 2->1", "weight_fifo 2->1"])
async def test_a_gated_sampler_restarted_with_another_groups_per_step_is_refused_or_rederived_and_trains_on(
    bundles: dict[str, Path], tmp_path: Path, sampler: str, groups_per_step: int, more_steps: int
) -> None:
    root = copy_root(bundles, sampler, tmp_path)
    config = config_for(root, sampler, groups_per_step)
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        with pytest.raises(BundleError) as refused:
            await controller.restore()
        assert refused.value.exit_code == 3
        assert "trainer.groups_per_step" in str(refused.value) and "--allow-config-change" in str(refused.value)
        assert controller.dataplane.data_ops == 0 and controller.state.trainer_step == 0  # refused before loading

        await controller.restore(allow_config_change=True)
        assert controller.state.trainer_step == FIRST_STEPS
        with anyio.fail_after(RUN_S):
            await controller.run(max_steps=FIRST_STEPS + more_steps)
        assert controller.state.trainer_step == FIRST_STEPS + more_steps
    steps = trained_after(config.telemetry.events_path, FIRST_STEPS)
    assert [len(prompts) for prompts in steps] == [groups_per_step] * more_steps
    trained = [tuple(p) for prompts in steps for p in prompts]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"

    # The re-derived state, and the dispatches made from it, checkpoint as a consistent bundle: it
    # restores under the new setting with no override and trains on.
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        await controller.restore()
        with anyio.fail_after(RUN_S):
            await controller.run(max_steps=FIRST_STEPS + more_steps + 1)
        assert controller.state.trainer_step == FIRST_STEPS + more_steps + 1
    await clear_partition(PARTITION)


def _without(field: str) -> Any:
    return lambda state: state.pop(field)


def _set(field: str, value: object) -> Any:
    return lambda state: state.update({field: value})


# Before the fix: a KeyError, a ValueError, or a run that never takes another step.
TAMPERED = [
    ("in_order", _without("dispatched"), "dispatched"),
    ("in_order", _set("dispatched", "many"), "dispatched"),
    ("in_order", _set("dispatched", 1000), "dispatched"),
    ("in_order", _set("refill", [FIRST_STEPS - 1]), "refill"),
    ("weight_fifo", _set("dispatched", -2), "dispatched"),
    ("weight_fifo", _set("quota", 3), "quota"),
]


@pytest.mark.parametrize(("sampler", "change", "field"), TAMPERED,
                         ids=["in_order no dispatched", "in_order dispatched not a number",
                              "in_order targets the ledger cannot meet", "in_order refill of a trained step",
                              "weight_fifo negative quota", "weight_fifo unknown field"])
async def test_a_restored_sampler_document_that_disagrees_with_the_ledger_is_refused_naming_the_field(
    bundles: dict[str, Path], tmp_path: Path, sampler: str, change: Any, field: str
) -> None:
    root = copy_root(bundles, sampler, tmp_path)
    bundle = layout.finalized_bundles(root)[-1]
    edit_json(bundle, layout.SIDECAR_FILE, lambda sidecar: change(sidecar["sampler"]["state"]))
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root, sampler, 2)) as controller:
        with pytest.raises(BundleError) as refused:
            await controller.restore()
        assert refused.value.exit_code == 3
        assert f"sampler state field {field!r}" in str(refused.value) and str(bundle) in str(refused.value)
        assert controller.dataplane.data_ops == 0 and controller.state.trainer_step == 0


@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo"])
async def test_a_gated_sampler_restarted_unchanged_resumes_its_state_as_saved(
    bundles: dict[str, Path], tmp_path: Path, sampler: str
) -> None:
    """The control: what a real run saves passes its sampler's check and is loaded as it is."""
    root = copy_root(bundles, sampler, tmp_path)
    saved = verify_bundle(layout.finalized_bundles(root)[-1])
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root, sampler, 2)) as controller:
        await controller.restore()
        assert controller.state.sampler.state() == saved.sidecar.sampler.state
        targets = {gid: entry.target_step for gid, entry in controller.state.ledger.entries().items()}
        assert targets == {gid: entry.target_step for gid, entry in saved.ledger.entries().items()}
        with anyio.fail_after(RUN_S):
            await controller.run(max_steps=FIRST_STEPS + 2)
        assert controller.state.trainer_step == FIRST_STEPS + 2
    await clear_partition(PARTITION)
