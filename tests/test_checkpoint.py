"""Checkpoint bundles on the session's real TQ: round trips, every validation failure, retries.

A golden bundle is made once per module by a real controller run; each test
copies it, edits the copy the way a disk, an operator or a bug would, and
restores it into a fresh controller.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import orjson
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from scd.checkpoint import layout
from scd.checkpoint import restore as restore_module
from scd.checkpoint.checkpointer import CheckpointFailed
from scd.checkpoint.restore import keep_history_linear, resolve_bundle
from scd.checkpoint.verify import BundleError, verify_bundle
from scd.daemon import Controller
from scd.errors import ConfigError, InvariantViolation
from scd.ledger import PromptState
from scd.replay import GroupMeta, ReplayIndex
from scd.schema import Outcome, Trigger
from scd.triggers import Triggers
from tests.conftest import REPO, SCD, tiny_config, toml_text, tree_digest
from tests.support.bundles import copy_bundles, edit_json, reseal
from tests.support.tq import clear_partition

PARTITION = "ckpt-golden"
CHECKPOINTING = {"enabled": True, "interval_s": 3600, "keep_last": 3}


def config_for(root: Path, **sections: dict[str, object]) -> Any:
    sections["checkpointing"] = {**CHECKPOINTING, "dir": str(root), **sections.get("checkpointing", {})}
    # Room above the golden run's 32: a test that adds a ready group to a bundle must not trip capacity.
    sections["async_rl"] = {"buffer_capacity_groups": 64, **sections.get("async_rl", {})}
    sections.setdefault("trainer", {}).update({"groups_per_step": 8})
    return tiny_config(root.parent, PARTITION, **sections)


async def read_rows(controller: Controller, keys: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every row of the groups ``keys``, by sibling id."""
    groups = await controller.dataplane.get_groups(keys)
    return {f"{key}/{i}": row for key, rows in zip(keys, groups, strict=True) for i, row in enumerate(rows)}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def golden(tq_session: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two finalized bundles (steps 3 and 6) from a real run, the last holding ready groups, and the TQ rows
    at it.  A step's groups are generated in one batch: on a loaded box that batch can still be running when
    step 6's bundle is cut, which then holds none (2026-12-07, twice), and the run is made again."""
    for _ in range(3):
        root = tmp_path_factory.mktemp("golden") / "checkpoints"
        await clear_partition(PARTITION)
        config = config_for(root, async_rl={"buffer_capacity_groups": 32})
        async with Controller.open(config) as controller:
            await controller.run(max_steps=3)
            await controller.run(max_steps=6)
            bundles = layout.finalized_bundles(root)
            sidecar = orjson.loads((bundles[-1] / layout.SIDECAR_FILE).read_bytes())
            if sidecar["groups"]:
                rows = await read_rows(controller, sorted(g["group_id"] for g in sidecar["groups"]))
                break
    else:
        raise AssertionError("three golden runs each cut step 6's bundle with no ready group")
    await clear_partition(PARTITION)
    assert [layout.step_of(b) for b in bundles] == [3, 6]
    return {"root": root, "rows": rows, "groups": len(sidecar["groups"])}


def newest(root: Path) -> Path:
    return layout.finalized_bundles(root)[-1]


def set_digest(sidecar: dict[str, Any], bundle: Path) -> None:
    """Keep the replay digest and counts consistent with an edited group list."""
    index = ReplayIndex()
    for g in sidecar["groups"]:
        index.add(GroupMeta(**{**g, "sample_ids": tuple(g["sample_ids"])}))
    sidecar["replay_digest"] = index.digest()
    info_path = bundle / layout.TRAINING_INFO_FILE
    info = orjson.loads(info_path.read_bytes())
    info.update(replay_digest=index.digest(), groups=len(index), samples=index.rows)
    info_path.write_bytes(orjson.dumps(info))


async def restore_into_fresh_controller(config: Any, **kwargs: Any) -> Controller:
    await clear_partition(config.data_plane.partition)
    async with Controller.open(config) as controller:
        await controller.restore(**kwargs)
        return controller


async def test_restore_gives_back_every_row_tensor_for_tensor(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    # A window wide enough that no restored group is evicted as stale, so all of them can be compared.
    config = config_for(root, async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 100}})
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        await controller.restore(allow_config_change=True)
        assert controller.state.trainer_step == 6
        assert controller.state.weight_version == 6
        rows = await read_rows(controller, sorted(controller.state.replay.keys()))
        ready = controller.state.ledger.in_state(PromptState.READY)
        # Training goes on from the restored state: two more steps, then a final bundle.
        await controller.run(max_steps=8)
        assert controller.state.trainer_step == 8
    before = golden["rows"]
    assert set(rows) == set(before) and len(rows) > 0
    for sid, (ids, logprobs) in rows.items():
        assert torch.equal(ids, before[sid][0])
        assert torch.equal(logprobs, before[sid][1])
    assert len(ready) == golden["groups"]
    assert [layout.step_of(b) for b in layout.finalized_bundles(root)] == [3, 6, 8]


async def test_a_bundle_from_before_the_truncated_flags_restores_and_its_rows_read_as_not_truncated(
        golden: dict[str, Any], tmp_path: Path) -> None:
    """GroupMeta.truncated (trainer.loss.mask_truncated's flags) is in every group a bundle records; a bundle
    written before it has no such key, and its replay digest is over each group's JSON without it."""
    root = copy_bundles(golden, tmp_path)
    bundle = newest(root)
    group_size = tiny_config(tmp_path, PARTITION).generation.group_size

    def as_before_the_flags(sidecar: dict[str, Any]) -> None:
        assert all(len(g.pop("truncated")) == group_size for g in sidecar["groups"])
        digest = hashlib.sha256()
        for group in sorted(sidecar["groups"], key=lambda g: g["group_id"]):
            digest.update(hashlib.sha256(msgspec.json.encode(group, order="sorted")).digest())
        sidecar["replay_digest"] = digest.hexdigest()
        info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
        info["replay_digest"] = digest.hexdigest()
        (bundle / layout.TRAINING_INFO_FILE).write_bytes(orjson.dumps(info))
    edit_json(bundle, layout.SIDECAR_FILE, as_before_the_flags)
    config = config_for(root, async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 100}})
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        await controller.restore(allow_config_change=True)
        groups = list(controller.state.replay.groups())
        rows = [r for group in await controller.read_batch(groups) for r in group]
        await controller.dataplane.clear_all()
    assert len(groups) == golden["groups"] > 0 and all(g.truncated == () for g in groups)
    assert len(rows) == golden["groups"] * group_size and not any(r.truncated for r in rows)


async def test_restore_reads_and_hashes_the_bundle_while_the_event_loop_goes_on(
        golden: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check of a bundle's files runs in a worker thread: hashing a large bundle takes seconds, in which
    signals and ``/healthz`` must still be answered.  Each check here first waits for the event loop to run;
    one called on the loop would wait out its timeout and fail the restore."""
    root = copy_bundles(golden, tmp_path)
    waiting: list[threading.Event] = []
    checked: list[str] = []

    def after_a_loop_tick(check: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            ticked = threading.Event()
            waiting.append(ticked)
            assert ticked.wait(timeout=10), f"restore ran {check.__name__} on the event loop"
            checked.append(check.__name__)
            return check(*args, **kwargs)
        return gated

    async def tick() -> None:
        while True:
            while waiting:
                waiting.pop().set()
            await anyio.sleep(0.005)

    for name in ("verify_files", "read_metadata", "require_cursor_ahead_of_ledger", "load_trainer_state_verified"):
        monkeypatch.setattr(restore_module, name, after_a_loop_tick(getattr(restore_module, name)))
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root)) as controller:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            report = await controller.restore()
            tg.cancel_scope.cancel()
    await clear_partition(PARTITION)
    assert report is not None and report.step == 6
    assert checked == ["verify_files", "read_metadata", "require_cursor_ahead_of_ledger",
                       "load_trainer_state_verified"]


def finished_over_budget(sidecar: dict[str, Any]) -> None:
    """a re-signed bundle with a finished sibling 200 tokens over its budget restored, then
    training crashed.  Index 7 of an in-flight group that stages none there."""
    entry = next(e for e in sidecar["ledger"]["entries"] if e[3] == "in_flight" and all(i != 7 for i, _ in e[6]))
    sidecar["finished_siblings"] = [f for f in sidecar["finished_siblings"] if (f[0], f[1]) != (entry[0], 7)]
    sidecar["sibling_scores"] = [s for s in sidecar["sibling_scores"] if (s[0], s[1]) != (entry[0], 7)]
    sidecar["finished_siblings"].append([entry[0], 7, [5] * 204, [-1.0] * 204, 0, "length"])


def score_of_no_sibling(sidecar: dict[str, Any], in_flight: bool) -> None:
    """A score the cut holds no finished sibling for: of a group not in flight, or of a version none has."""
    group_id = next((e[0] for e in sidecar["ledger"]["entries"] if e[3] == "in_flight"), "e0-p0") if in_flight \
        else "e99-p0"
    sidecar["sibling_scores"].append([group_id, 0, 10_000, 1.0, {}])


BROKEN: list[tuple[str, Callable[[Path], None], str]] = [
    ("schema version",
     lambda b: edit_json(b, layout.TRAINING_INFO_FILE, lambda d: d.update(schema_version=99), seal=False),
     "schema_version 99"),
    ("truncated sidecar",
     lambda b: (b / layout.SIDECAR_FILE).write_bytes((b / layout.SIDECAR_FILE).read_bytes()[:100]),
     "does not match its BLAKE3 digest"),
    ("truncated and resealed sidecar",
     lambda b: ((b / layout.SIDECAR_FILE).write_bytes((b / layout.SIDECAR_FILE).read_bytes()[:100]), reseal(b)),
     "not valid JSON"),
    ("wrong digest",
     lambda b: edit_json(b, layout.SIDECAR_FILE, lambda d: d["groups"][0].update(rewards=[9.0] * 8)),
     "replay digest mismatch"),
    ("group count",
     lambda b: edit_json(b, layout.TRAINING_INFO_FILE, lambda d: d.update(groups=d["groups"] + 1)),
     "training_info says"),
    ("epoch",
     lambda b: edit_json(b, layout.DATALOADER_FILE, lambda d: d.update(epoch=d["epoch"] + 1)),
     "dataloader epoch differs"),
    ("tampered data_plane file",
     lambda b: next(p for p in (b / layout.DATA_PLANE_DIR).rglob("*.pkl")).write_bytes(b"\x80\x04evil"),
     "data_plane/"),
    ("extra data_plane file",
     lambda b: (b / layout.DATA_PLANE_DIR / "extra.pkl").write_bytes(b"x"),
     "unexpected files"),
    ("legacy replay_buffer.pt",
     lambda b: torch.save({"rows": torch.zeros(2)}, b / layout.LEGACY_REPLAY_FILE),
     "legacy tensor-bearing replay_buffer.pt"),
    ("edited after finalize",
     lambda b: edit_json(b, layout.TRAINING_INFO_FILE, lambda d: d.update(step=d["step"] + 1), seal=False),
     "does not match its commit marker"),
    ("cursor behind a restored prompt",
     lambda b: edit_json(b, layout.DATALOADER_FILE, lambda d: d.update(cursor=0)),
     "behind restored prompt"),
    # Consistent-but-wrong groups (re-signed, digest and counts recomputed): each names its group.
    ("rewards shorter than the group",
     lambda b: edit_group(b, lambda g: g.update(rewards=g["rewards"][:-1])),
     "7 rewards"),
    ("seq_lens longer than the group",
     lambda b: edit_group(b, lambda g: g.update(seq_lens=[*g["seq_lens"], 3])),
     "9 seq_lens"),
    ("duplicate sample id",
     lambda b: edit_group(b, lambda g: g["sample_ids"].__setitem__(1, g["sample_ids"][0])),
     "names rows that are not its own"),
    ("sample ids swapped between groups", lambda b: swap_sample_ids(b), "names rows that are not its own"),
    ("no data_plane/",
     lambda b: (shutil.rmtree(b / layout.DATA_PLANE_DIR), reseal(b)),
     "holds no data_plane/"),
    ("no dataloader file",
     lambda b: ((b / layout.DATALOADER_FILE).unlink(), reseal(b)),
     "train_dataloader.json is not part of the bundle"),
    # Refused against the config (the budget), not offline.
    ("finished sibling over the budget",
     lambda b: edit_json(b, layout.SIDECAR_FILE, finished_over_budget),
     "holds 204 completion tokens, more than the 4 of generation.max_new_tokens"),
    # Re-signed (marker recomputed): step and weight_version advance together from 0.
    ("step and weight_version disagree",
     lambda b: edit_json(b, layout.TRAINING_INFO_FILE, lambda d: d.update(weight_version=d["weight_version"] + 1)),
     "records step 6 but weight_version 7"),
    # The cut's own siblings of in-flight groups: one for a group the ledger holds ready is no such sibling.
    ("finished sibling of a ready group",
     lambda b: edit_json(b, layout.SIDECAR_FILE, lambda d: d["finished_siblings"].append(
         [d["groups"][0]["group_id"], 0, [5], [-1.0], 6, "stop"])),
     "does not hold in flight"),
    # A score is part of the cut only beside its finished sibling, of the very version.
    ("score of a group not in flight",
     lambda b: edit_json(b, layout.SIDECAR_FILE, lambda d: score_of_no_sibling(d, in_flight=False)),
     "the score of sibling 0 of group e99-p0 is for a group the cut's ledger does not hold in flight"),
    ("score of no finished sibling",
     lambda b: edit_json(b, layout.SIDECAR_FILE, lambda d: score_of_no_sibling(d, in_flight=True)),
     "(version 10000) is for no finished sibling of the cut"),
]


def edit_group(bundle: Path, change: Callable[[dict[str, Any]], None]) -> None:
    def edit(sidecar: dict[str, Any]) -> None:
        change(sidecar["groups"][0])
        set_digest(sidecar, bundle)
    edit_json(bundle, layout.SIDECAR_FILE, edit)


def swap_sample_ids(bundle: Path) -> None:
    """The first group names another group's rows: the second's where the cut holds two (under load the golden
    run's last cut may hold one ready group), else those of a group of an epoch the run never reached."""
    def edit(sidecar: dict[str, Any]) -> None:
        first, *others = sidecar["groups"]
        theirs = others[0]["sample_ids"] if others else [
            s.replace(first["group_id"], "e99-p0", 1) for s in first["sample_ids"]]
        first["sample_ids"] = theirs
        set_digest(sidecar, bundle)
    edit_json(bundle, layout.SIDECAR_FILE, edit)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# The trainer state's files are hashed while the trainer loads them: a mismatch is refused all the same, also
# where the damage makes the load itself fail first.
POLICY_BROKEN: list[tuple[str, Callable[[Path], None], str]] = [
    ("flipped byte in model.pt", lambda b: _flip_last_byte(b / layout.MODEL_FILE),
     f"{layout.MODEL_FILE} does not match its BLAKE3 digest"),
    ("truncated optimizer.pt",
     lambda b: (b / layout.OPTIMIZER_FILE).write_bytes((b / layout.OPTIMIZER_FILE).read_bytes()[:100]),
     f"{layout.OPTIMIZER_FILE} does not match its BLAKE3 digest"),
]


@pytest.mark.parametrize(("name", "breaker", "message"), BROKEN + POLICY_BROKEN,
                         ids=[b[0] for b in BROKEN + POLICY_BROKEN])
async def test_broken_bundle_is_refused_and_left_untouched(golden: dict[str, Any], tmp_path: Path, name: str,
                                                           breaker: Callable[[Path], None], message: str) -> None:
    root = copy_bundles(golden, tmp_path)
    bundle = newest(root)
    breaker(bundle)
    before = tree_digest(root)
    with pytest.raises(InvariantViolation) as info:
        await restore_into_fresh_controller(config_for(root), restore_from=bundle)
    assert message in str(info.value)
    assert str(bundle) in str(info.value)
    assert tree_digest(root) == before


def _drop_first_group(bundle: Path) -> None:
    def change(sidecar: dict[str, Any]) -> None:
        dropped = sidecar["groups"].pop(0)
        for entry in sidecar["ledger"]["entries"]:
            if entry[0] == dropped["group_id"]:
                entry[3] = "consumed"
        set_digest(sidecar, bundle)
    edit_json(bundle, layout.SIDECAR_FILE, change)


def _invent_a_group(bundle: Path) -> None:
    def change(sidecar: dict[str, Any]) -> None:
        # A consumed prompt comes back as ready: a well-formed group whose rows TQ never had.
        entry = next(e for e in sidecar["ledger"]["entries"] if e[3] == "consumed")
        entry[3] = "ready"
        group_id, epoch, prompt_id = entry[:3]
        ghost = dict(sidecar["groups"][0])
        ghost.update(group_id=group_id, epoch=epoch, prompt_id=prompt_id,
                     sample_ids=[f"{group_id}/{i}" for i in range(len(ghost["sample_ids"]))])
        sidecar["groups"].append(ghost)
        set_digest(sidecar, bundle)
    edit_json(bundle, layout.SIDECAR_FILE, change)


@pytest.mark.parametrize(("breaker", "message"), [
    (_drop_first_group, "1 groups in TQ that are neither in the cut nor put after it"),
    (_invent_a_group, "1 groups of the cut missing from TQ"),
], ids=["unexpected TQ rows", "missing TQ rows"])
async def test_inventory_mismatch_with_tq_is_refused(golden: dict[str, Any], tmp_path: Path,
                                                     breaker: Callable[[Path], None], message: str) -> None:
    root = copy_bundles(golden, tmp_path)
    bundle = newest(root)
    breaker(bundle)
    before = tree_digest(root)
    with pytest.raises(InvariantViolation, match="the cut and TransferQueue disagree") as info:
        await restore_into_fresh_controller(config_for(root))
    assert message in str(info.value)
    assert tree_digest(root) == before


def test_a_schema_2_bundle_is_refused_with_what_to_do(golden: dict[str, Any], tmp_path: Path) -> None:
    """Bundles of the scd before a TQ key per group: their snapshots hold per-row tensors."""
    root = copy_bundles(golden, tmp_path)
    bundle = newest(root)
    edit_json(bundle, layout.TRAINING_INFO_FILE, lambda d: d.update(schema_version=2), seal=False)
    (bundle / layout.COMMIT_MARKER).write_text(layout.sha256_file(bundle / layout.TRAINING_INFO_FILE))
    with pytest.raises(BundleError, match="schema_version 2: its TQ snapshot stores a row per sample") as info:
        verify_bundle(bundle)
    assert "move its bundles out of checkpointing.dir" in str(info.value)


async def test_rows_committed_during_the_tq_save_are_cleared_at_restore(golden: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """A group committed while the save ran is in TQ's snapshot but not in the cut: restore clears it,
    and its prompt, in flight in the cut's ledger, is generated again."""
    root = copy_bundles(golden, tmp_path)
    bundle = newest(root)
    late: dict[str, Any] = {}

    def change(sidecar: dict[str, Any]) -> None:
        late.update(sidecar["groups"].pop(0))
        for entry in sidecar["ledger"]["entries"]:
            if entry[0] == late["group_id"]:
                entry[3] = "in_flight"
        late["already_uncut"] = len(sidecar["uncut_keys"])
        sidecar["uncut_keys"] = sorted({*sidecar["uncut_keys"], late["group_id"]})
        set_digest(sidecar, bundle)
    edit_json(bundle, layout.SIDECAR_FILE, change)

    controller = await restore_into_fresh_controller(
        config_for(root, async_rl={"sampler": {"name": "windowed", "max_staleness_versions": 100}}),
        allow_config_change=True)
    assert late["group_id"] not in controller.state.replay
    assert controller.state.ledger.state_of(late["group_id"]) is PromptState.IN_FLIGHT
    assert len(controller.state.replay) == golden["groups"] - 1
    events = [orjson.loads(line) for line in Path(controller.config.telemetry.events_path).read_bytes().splitlines()]
    restore_event = [e for e in events if e["event"] == "restore"][-1]
    # Its group, and any the golden run itself committed while that save ran.
    assert 1 <= restore_event["uncut_groups_cleared"] <= 1 + late["already_uncut"]


@pytest.mark.parametrize(("sections", "message"), [
    ({"async_rl": {"sampler": {"name": "weight_fifo", "max_staleness_versions": 1}}}, "sampler 'windowed'"),
    ({"async_rl": {"buffer_capacity_groups": 8}}, "async_rl.buffer_capacity_groups = 8"),
    ({"generation": {"group_size": 4}}, "generation.group_size"),
], ids=["sampler changed", "capacity too small", "fingerprint changed"])
async def test_config_that_does_not_fit_the_bundle_is_refused(golden: dict[str, Any], tmp_path: Path,
                                                              sections: dict[str, Any], message: str) -> None:
    root = copy_bundles(golden, tmp_path)
    with pytest.raises(InvariantViolation, match=r"checkpoint .*step_00000006") as info:
        await restore_into_fresh_controller(config_for(root, **sections))
    assert message in str(info.value)


async def test_partition_changed_is_refused(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    config = config_for(root)
    config.data_plane.partition = "another"
    with pytest.raises(InvariantViolation, match="holds TQ partition 'ckpt-golden'"):
        await restore_into_fresh_controller(config)


async def test_corrupt_newest_names_the_newest_good_bundle(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    (newest(root) / layout.SIDECAR_FILE).write_bytes(b"{")
    with pytest.raises(InvariantViolation) as info:
        await restore_into_fresh_controller(config_for(root))
    text = str(info.value)
    good = root / "step_00000003"
    assert "step_00000006" in text and f"restart with --restore-from {good} --discard-newer" in text
    # What `scd run --restore-from GOOD --discard-newer` does before Ray starts; the corrupt bundle is kept.
    with pytest.raises(ConfigError, match="--discard-newer"):
        await restore_into_fresh_controller(config_for(root), restore_from=good)
    keep_history_linear(root, good, discard_newer=True)
    controller = await restore_into_fresh_controller(config_for(root), restore_from=good)
    assert controller.state.trainer_step == 3
    [moved] = (root / layout.ABANDONED_DIR).iterdir()
    assert (moved / "step_00000006" / layout.SIDECAR_FILE).read_bytes() == b"{"


def test_scd_run_restoring_a_bundle_that_fails_verification_names_a_good_older_one(
    golden: dict[str, Any], tmp_path: Path
) -> None:
    """Chosen with --restore-from or not, a bundle that does not verify names the newest older one that does."""
    root = copy_bundles(golden, tmp_path)
    bad, good = newest(root), root / "step_00000003"
    (bad / layout.SIDECAR_FILE).write_bytes((bad / layout.SIDECAR_FILE).read_bytes()[:100])
    before = tree_digest(root)
    # The golden run's config: a bundle is checked against the config before Ray starts, and only its
    # corruption may stop this run.
    data = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())
    for section, values in {"run": {"output_dir": str(tmp_path / "out")}, "data_plane": {"partition": PARTITION},
                            "telemetry": {"metrics_port": 0}, "checkpointing": {"dir": str(root)}}.items():
        data[section].update(values)
    config = tmp_path / "scd.toml"
    config.write_text(toml_text(data))
    out = subprocess.run([*SCD, "run", str(config), "--restore-from", str(bad)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    assert f"checkpoint {bad}: " in out.stderr and "does not match its BLAKE3 digest" in out.stderr
    assert f"restart with --restore-from {good} --discard-newer" in out.stderr, out.stderr[-3000:]
    assert tree_digest(root) == before


def test_abandoned_bundles_are_never_restored_listed_or_retained(tmp_path: Path) -> None:
    from scd.checkpoint.save import apply_retention

    moved = tmp_path / layout.ABANDONED_DIR / "20261201T000000.000000Z"
    kept = [layout.step_dir(tmp_path, step) for step in (1, 2, 3)]
    for bundle in [*kept, layout.step_dir(moved, 9)]:
        bundle.mkdir(parents=True)
        (bundle / layout.COMMIT_MARKER).write_text("x")
    (layout.step_dir(moved, 9) / layout.LEGACY_REPLAY_FILE).write_bytes(b"x")
    before = tree_digest(moved)
    # Had retention counted the abandoned step 9 as the newest, it would have deleted step 2 too.
    apply_retention(tmp_path, keep_last=2, written=kept[-1])
    assert layout.finalized_bundles(tmp_path) == kept[1:]
    assert not layout.leftover_tmp_dirs(tmp_path)
    assert resolve_bundle(tmp_path, None) == kept[-1]  # and the legacy file there refuses nothing
    assert tree_digest(moved) == before


async def test_leftover_tmp_is_removed_and_never_restored(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    shutil.copytree(newest(root), root / "step_00000009.tmp")
    controller = await restore_into_fresh_controller(config_for(root))
    assert controller.state.trainer_step == 6
    assert not (root / "step_00000009.tmp").exists()


async def test_no_artifact_starts_empty(tmp_path: Path, tq_session: None) -> None:
    controller = await restore_into_fresh_controller(config_for(tmp_path / "nothing-here"))
    assert controller.state.trainer_step == 0 and len(controller.state.replay) == 0


async def test_a_sampler_without_replay_support_restores_in_shadow_mode(tmp_path: Path, tq_session: None) -> None:
    root = tmp_path / "checkpoints"
    sampler = {"sampler": {"name": "tests.test_samplers:ShadowInOrder", "max_staleness_versions": 1}}
    config = config_for(root, async_rl=sampler)
    await clear_partition(PARTITION)
    async with Controller.open(config) as controller:
        await controller.run(max_steps=3)
    sidecar = orjson.loads((newest(root) / layout.SIDECAR_FILE).read_bytes())
    ready_before = {e[0] for e in sidecar["ledger"]["entries"] if e[3] == "ready"}
    in_flight_before = {e[0] for e in sidecar["ledger"]["entries"] if e[3] == "in_flight"}
    info = orjson.loads((newest(root) / layout.TRAINING_INFO_FILE).read_bytes())
    assert info["supports_replay_checkpoint"] is False
    assert (newest(root) / layout.DATA_PLANE_DIR).is_dir()
    controller = await restore_into_fresh_controller(config_for(root, async_rl=sampler))
    assert len(controller.state.replay) == 0
    assert set(controller.state.ledger.in_state(PromptState.IN_FLIGHT)) == ready_before | in_flight_before
    targets = sorted(controller.state.ledger.entry(g).target_step for g in ready_before | in_flight_before)
    assert targets[0] == 3


@pytest.mark.parametrize("name", ["in_order", "weight_fifo"])
async def test_gated_samplers_restore_exactly_where_they_stopped(tmp_path: Path, tq_session: None, name: str) -> None:
    root = tmp_path / "checkpoints"
    sampler = {"sampler": {"name": name, "max_staleness_versions": 1}}
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root, async_rl=sampler)) as controller:
        await controller.run(max_steps=3)
    bundle = newest(root)
    sidecar = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())
    assert orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())["supports_replay_checkpoint"] is True
    entries = {e[0]: e for e in sidecar["ledger"]["entries"]}

    await clear_partition(PARTITION)
    async with Controller.open(config_for(root, async_rl=sampler)) as controller:
        await controller.restore()
        state = controller.state
        # Nothing finished is dropped or made again: the ready groups are back with their rows and
        # targets, in-flight prompts keep their targets, and the quota continues where it stopped.
        assert [g.group_id for g in state.replay.groups()] == [g["group_id"] for g in sidecar["groups"]]
        assert state.sampler.state() == sidecar["sampler"]["state"]
        for group_id in state.ledger.in_state(PromptState.IN_FLIGHT):
            assert state.ledger.entry(group_id).target_step == entries[group_id][5]
        await controller.run(max_steps=6)
        assert state.trainer_step == 6
    events = [orjson.loads(line) for line in (root.parent / "out" / "events.jsonl").read_bytes().splitlines()]
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["shadow"] is False and restore["groups_restored"] == len(sidecar["groups"])
    trained = [e for e in events if e["event"] == "train_step"]
    assert [e["step"] for e in trained] == [1, 2, 3, 4, 5, 6]
    consumed = [tuple(p) for e in trained for p in e["prompt_ids"]]
    assert len(consumed) == len(set(consumed)), "a prompt was trained twice"
    await clear_partition(PARTITION)


async def test_io_failures_are_retried_then_stop_the_daemon_leaving_bundles_intact(
    golden: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_bundles(golden, tmp_path)
    before = tree_digest(root)

    def disk_full(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    monkeypatch.setattr(layout, "fsync_tree", disk_full)
    config = config_for(root, checkpointing={"max_consecutive_failures": 2, "interval_s": 0.2})
    await clear_partition(PARTITION)
    with pytest.raises(BaseExceptionGroup) as info:
        async with Controller.open(config) as controller:
            await controller.restore()
            await controller.run(Triggers(), max_steps=10_000)
    failed = info.value.subgroup(CheckpointFailed)
    assert failed is not None and "2 consecutive checkpoint failures (last: disk_full" in str(failed.exceptions[0])
    assert controller.checkpointer is not None
    assert controller.checkpointer.statistics().failed == 2
    assert tree_digest(root) == before
    assert not layout.leftover_tmp_dirs(root)


@pytest.mark.parametrize(("name", "breaker", "message"), BROKEN[:3] + BROKEN[6:10] + BROKEN[-4:] + POLICY_BROKEN[:1],
                         ids=[b[0] for b in BROKEN[:3] + BROKEN[6:10] + BROKEN[-4:] + POLICY_BROKEN[:1]])
def test_scd_checkpoint_verify_rejects_offline(golden: dict[str, Any], tmp_path: Path, name: str,
                                               breaker: Callable[[Path], None], message: str) -> None:
    root = copy_bundles(golden, tmp_path)
    good = subprocess.run([*SCD, "checkpoint", "verify", str(newest(root))], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    breaker(newest(root))
    bad = subprocess.run([*SCD, "checkpoint", "verify", str(newest(root))], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 3
    assert message in bad.stderr


def test_scd_export_of_a_tiny_transformer_bundle_exits_2_naming_why_and_writes_nothing(
        golden: dict[str, Any], tmp_path: Path) -> None:
    out = subprocess.run([*SCD, "export", str(newest(golden["root"])), str(tmp_path / "hf")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "embedded tiny transformer" in out.stderr and "init-tiny" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_scd_checkpoint_inspect_and_list(golden: dict[str, Any]) -> None:
    root = golden["root"]
    out = subprocess.run([*SCD, "checkpoint", "inspect", str(newest(root)), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = orjson.loads(out.stdout)
    for key in ("step", "weight_version", "epoch", "sampler", "groups", "samples", "ledger", "sidecar_bytes",
                "data_plane_bytes", "digest", "trigger", "crash_restores", "prefixes_part_way", "prefix_tokens"):
        assert key in summary
    assert summary["step"] == 6 and summary["sampler"] == "windowed" and summary["storage_units"] == 1
    assert summary["ledger"]["ready"] == summary["groups"] == golden["groups"]
    # The golden run scores with the default reward, the character match; its in-flight siblings' scores.
    assert set(summary["reward_components"]) == {"match"} and 0 <= summary["reward_components"]["match"] <= 1
    assert 0 <= summary["siblings_scored"] <= summary["siblings_finished"]
    listing = subprocess.run([*SCD, "checkpoint", "list", str(root)], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0
    assert "step_00000006" in listing.stdout and "latest" in listing.stdout


async def test_checkpoint_requests_coalesce_and_land_at_step_boundaries(tmp_path: Path, tq_session: None) -> None:
    root = tmp_path / "checkpoints"
    config = config_for(root)
    await clear_partition(PARTITION)
    triggers = Triggers()
    async with Controller.open(config) as controller:

        async def operator() -> None:
            while controller.state.trainer_step < 2:
                await anyio.sleep(0.01)
            for _ in range(3):
                triggers.request_checkpoint()
            while not layout.finalized_bundles(root):
                await anyio.sleep(0.01)
            signal_step = layout.step_of(layout.finalized_bundles(root)[0])
            while controller.state.trainer_step <= (signal_step or 0):
                await anyio.sleep(0.01)
            triggers.shutdown.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            await controller.run(triggers, max_steps=10_000)
    events = [orjson.loads(line) for line in Path(config.telemetry.events_path).read_text().splitlines()]
    done = [(e["reason"], e["step"]) for e in events if e["event"] == "checkpoint" and e["outcome"] == "completed"]
    assert [reason for reason, _ in done] == ["signal", "shutdown"]
    # The bundle's step is the trainer step of the cut, and its weights are that step's weights.
    signal_step = done[0][1]
    info = orjson.loads((layout.step_dir(root, signal_step) / layout.TRAINING_INFO_FILE).read_bytes())
    assert info["step"] == info["weight_version"] == signal_step


async def test_an_attempt_without_progress_is_skipped_with_its_reason(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    before = tree_digest(root)
    labels = {"outcome": "skipped", "reason": "no_progress"}
    count_before = REGISTRY.get_sample_value("scd_checkpoint_attempts_total", labels) or 0.0
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root)) as controller:
        await controller.restore()
        assert controller.checkpointer is not None
        assert await controller.checkpointer.attempt(Trigger.SIGNAL) is Outcome.SKIPPED
    assert REGISTRY.get_sample_value("scd_checkpoint_attempts_total", labels) == count_before + 1
    assert tree_digest(root) == before


async def test_latest_naming_a_missing_directory_is_only_a_hint(golden: dict[str, Any], tmp_path: Path) -> None:
    root = copy_bundles(golden, tmp_path)
    (root / layout.LATEST).write_text("step_00000099")
    controller = await restore_into_fresh_controller(config_for(root))
    assert controller.state.trainer_step == 6


async def test_unwritable_checkpoint_dir_fails_with_io_error_and_stops(tmp_path: Path, tq_session: None) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    config = config_for(blocker, checkpointing={"max_consecutive_failures": 2, "interval_s": 0.2})
    await clear_partition(PARTITION)
    labels = {"outcome": "failed", "reason": "io_error"}
    count_before = REGISTRY.get_sample_value("scd_checkpoint_attempts_total", labels) or 0.0
    with pytest.raises(BaseExceptionGroup) as info:
        async with Controller.open(config) as controller:
            await controller.restore()
            await controller.run(max_steps=10_000)
    failed = info.value.subgroup(CheckpointFailed)
    assert failed is not None and "io_error" in str(failed.exceptions[0])
    assert REGISTRY.get_sample_value("scd_checkpoint_attempts_total", labels) == count_before + 2
    assert blocker.read_text().startswith("a file")


async def test_checkpoint_directories_are_private(golden: dict[str, Any]) -> None:
    root = golden["root"]
    assert root.stat().st_mode & 0o777 == 0o700
    for bundle in layout.finalized_bundles(root):
        assert bundle.stat().st_mode & 0o777 == 0o700
        assert (bundle / layout.POLICY_DIR).stat().st_mode & 0o777 == 0o700


async def test_a_jsonl_task_edited_in_place_is_refused(tmp_path: Path, tq_session: None) -> None:
    task = tmp_path / "task.jsonl"
    rows = [orjson.dumps({"prompt": f"{i:04d}=", "answer": f"{i:04d}"[::-1]}) for i in range(64)]
    task.write_bytes(b"\n".join(rows))
    root = tmp_path / "checkpoints"
    jsonl = {"name": "jsonl", "path": str(task)}
    await clear_partition(PARTITION)
    async with Controller.open(config_for(root, task=jsonl)) as controller:
        await controller.run(max_steps=3)
    before = tree_digest(root)

    # Same number of rows, one answer changed: prompt ids would silently change meaning.
    rows[0] = orjson.dumps({"prompt": "0000=", "answer": "1111"})
    task.write_bytes(b"\n".join(rows))
    with pytest.raises(InvariantViolation, match=r"(?s)step_00000003.*\n  task\.content_sha256: "):
        await restore_into_fresh_controller(config_for(root, task=jsonl))

    # Fewer rows, even with the override: the ledger names prompts the file no longer has.
    task.write_bytes(b"\n".join(rows[:5]))
    with pytest.raises(InvariantViolation, match=r"step_00000003.*task\.path holds 5 prompts"):
        await restore_into_fresh_controller(config_for(root, task=jsonl), allow_config_change=True)
    assert tree_digest(root) == before


def test_retention_never_deletes_the_bundle_just_written(tmp_path: Path) -> None:
    """After --restore-from an older bundle, the new bundle's step is below those already there."""
    from scd.checkpoint.save import apply_retention

    for step in (1, 2, 5, 6):
        (layout.step_dir(tmp_path, step)).mkdir()
        (layout.step_dir(tmp_path, step) / layout.COMMIT_MARKER).write_text("x")
    apply_retention(tmp_path, keep_last=2, written=layout.step_dir(tmp_path, 2))
    assert [layout.step_of(b) for b in layout.finalized_bundles(tmp_path)] == [2, 6]
