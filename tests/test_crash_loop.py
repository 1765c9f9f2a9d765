"""A run SIGKILLed at seeded random moments still finishes, and the event log proves nothing was lost.

Each sampler runs the loop; the gated ones (weight_fifo, in_order) restore their dispatch state
and ready groups like the windowed one.  `make soak` runs it with more kills (SCD_SOAK_KILLS) and
prints what the crashes cost in waste: tokens of groups dropped stale (by the runs, and by the
restores, which report the groups they restored already stale) over tokens generated, summed over
every process.  Admission is paced to the staleness window, so little is generated to go stale.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import orjson
import pytest

from scd.checkpoint import layout
from scd.checkpoint.verify import VerifiedBundle, verify_bundle
from scd.config import load_config
from scd.dataloader import DataloaderState, PromptOrder
from scd.ledger import PromptState
from scd.report import goodput_totals
from scd.skew import Fate
from scd.tasks import build_task
from tests.conftest import ScdProcess, write_config
from tests.support.bundles import part_way_siblings
from tests.support.waiting import wait_until
from tests.test_dynamic_sampling import CONSTANT_FOR_SOME_PROMPTS, constant_prompt

CHECKPOINTS = "\n[checkpointing]\nenabled = true\ninterval_s = 0.5\nkeep_last = 3\n"
KILLS = int(os.environ.get("SCD_SOAK_KILLS", "8"))
# The gated samplers share every code path but their dispatch state: fewer kills each.
SAMPLER_KILLS = {"windowed": KILLS, "weight_fifo": max(2, KILLS // 4), "in_order": max(2, KILLS // 4)}
GROUPS_PER_STEP = 8  # tests/conftest.py TINY
PROMPTS = 64
WASTE_LIMIT = 0.05  # of the tokens generated, across every kill and restore (47% before pacing)


def effective_history(events: list[dict]) -> list[dict]:
    """Train steps that count: a restore to step k discards the steps after k that the crash lost."""
    history: list[dict] = []
    for event in events:
        if event["event"] == "restore":
            history = [e for e in history if e["step"] <= event["step"]]
        elif event["event"] == "train_step":
            history.append(event)
    return history


# The synthetic engine with completions long enough to be part-way at most cuts: a restore resumes them.
PREFIXES = "prefixes"
SAMPLER_KILLS[PREFIXES] = max(2, KILLS // 4)
SYNTHETIC_LONG = """[generation]
group_size = 8
max_inflight_prompts = 16
max_new_tokens = 40
backend = "synthetic"
[generation.synthetic]
tokens_per_s = 3000.0
min_completion_tokens = 20
max_completion_tokens = 39
batch_groups = 4
max_concurrent_batches = 2
"""


def wait_until_the_newest_bundle_holds_part_way_siblings(root: Path) -> None:
    """The prefixes loop kills only then, so that the next process's restore has part-way siblings to resume
    (a random moment on a loaded box can fall before any bundle holds one).  Polled often: a bundle comes
    every 0.5 s."""
    wait_until(lambda: (bundles := layout.finalized_bundles(root)) and part_way_siblings(bundles[-1]),
               60, "a bundle holding a part-way sibling", poll_s=0.02)


# Dynamic sampling on: the groups of prompts whose reward is constant are filtered, each exactly once per epoch
# across the kills (tests/test_dynamic_sampling.py has the reward).
FILTERED = "filtered"
SAMPLER_KILLS[FILTERED] = max(3, KILLS // 4)


def filtered_in(bundle: Path) -> int:
    fates = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())["prompt_fates"].values()
    return sum(f.get(Fate.FILTERED, 0) for f in fates)


def wait_until_the_newest_bundle_holds_more_filtered_prompts(root: Path, than: int) -> int:
    """The filtered loop kills only then, so that each restore puts back prompts filtered since the last one
    (a random moment on a loaded box can fall before the first bundle).  Returns how many it holds."""
    held = [than]

    def more() -> bool:
        bundles = layout.finalized_bundles(root)
        held[0] = filtered_in(bundles[-1]) if bundles else than
        return held[0] > than

    wait_until(more, 60, f"a bundle holding more than {than} filtered prompts", poll_s=0.05)
    return held[0]


def crash_loop_config(tmp_path: Path, sampler: str, ray_address: str) -> Path:
    name = "windowed" if sampler in (PREFIXES, FILTERED) else sampler
    sampler_section = f'[async_rl.sampler]\nname = "{name}"\nmax_staleness_versions = 1\n'
    config = write_config(tmp_path, max_steps=100_000, extra=CHECKPOINTS + sampler_section, ray_address=ray_address)
    if sampler == PREFIXES:
        text = config.read_text()
        generation = text[text.index("[generation]"):text.index("[trainer]")]
        text = text.replace(generation, SYNTHETIC_LONG + "\n").replace(
            'name = "reverse"\n', 'name = "reverse"\nmin_digits = 40\nmax_digits = 40\n')
        config.write_text(text + "\n[model]\nmax_len = 128\n")
    if sampler == FILTERED:
        (tmp_path / "constant_reward.py").write_text(CONSTANT_FOR_SOME_PROMPTS)
        text = config.read_text().replace("[async_rl]\n", "[async_rl]\ndrop_zero_variance_groups = true\n")
        config.write_text(text + '\n[[task.rewards]]\nfunction = "constant_reward:reward"\n')
    return config


def check_each_constant_prompt_filtered_once_an_epoch(config: Path, consumed: list[tuple[int, int]],
                                                      bundle: VerifiedBundle) -> int:
    """No zero-variance group was trained, and every constant prompt admitted (in any epoch, across every kill)
    is filtered exactly once or still in flight: the ledger's and the fates' counts agree.  Returns how many."""
    task = load_config(config).task
    constant = {p.prompt_id for p in build_task(task) if constant_prompt(p.answer)}
    assert not {prompt_id for _, prompt_id in consumed} & constant, "a zero-variance group was trained"
    counts, entries, dataloader = bundle.ledger.counts(), bundle.ledger.entries().values(), bundle.dataloader
    ranks = PromptOrder(PROMPTS, DataloaderState(seed=task.seed)).ranks(dataloader.epoch)
    admitted = dataloader.epoch * len(constant) + sum(ranks[p] < dataloader.cursor for p in constant)
    in_flight = sum(e.state is PromptState.IN_FLIGHT and e.prompt_id in constant for e in entries)
    assert counts["filtered"] + in_flight == admitted
    assert all(e.prompt_id in constant for e in entries if e.state is PromptState.FILTERED)
    fates = bundle.sidecar.prompt_fates.values()
    assert sum(f[Fate.FILTERED] for f in fates) == counts["filtered"] > 0
    assert sum(f[Fate.TRAINED] for f in fates) == counts["consumed"]
    return counts["filtered"]


@pytest.mark.parametrize("sampler", list(SAMPLER_KILLS))
def test_crash_loop_loses_nothing(tmp_path: Path, scd_processes: list[ScdProcess], sampler: str,
                                  session_ray: str) -> None:
    rng = random.Random(1234)
    config = crash_loop_config(tmp_path, sampler, session_ray)
    root = tmp_path / "out" / "checkpoints"
    ready_in: dict[str, int] = {}  # bundle name -> its ready groups, for each bundle a start found newest

    def note_newest_bundle() -> None:
        if layout.finalized_bundles(root):
            newest = layout.finalized_bundles(root)[-1]
            ready_in[newest.name] = verify_bundle(newest).info.groups

    def starts() -> int:
        events_path = tmp_path / "out" / "events.jsonl"
        return events_path.read_bytes().count(b'"event":"start"') if events_path.exists() else 0

    kills = filtered = 0
    while kills < SAMPLER_KILLS[sampler]:
        note_newest_bundle()
        started_before = starts()
        scd = ScdProcess(config)
        scd_processes.append(scd)
        # Its start event written: the kill lands in its restore or its steps (on a loaded box the controller's
        # opening alone can outlast the random wait).
        deadline = time.monotonic() + 120
        while starts() == started_before:
            assert scd.proc.poll() is None and time.monotonic() < deadline, scd.output()[-3000:]
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.5))
        if sampler == PREFIXES:
            wait_until_the_newest_bundle_holds_part_way_siblings(root)
        if sampler == FILTERED:
            filtered = wait_until_the_newest_bundle_holds_more_filtered_prompts(root, filtered)
        assert scd.proc.poll() is None, scd.output()[-3000:]
        scd.kill_group()
        kills += 1

    k = layout.step_of(layout.finalized_bundles(root)[-1]) or 0
    note_newest_bundle()
    final = ScdProcess(config, "--max-steps", str(k + 3))
    scd_processes.append(final)
    assert final.wait(timeout=300) == 0, final.output()[-3000:]

    events_path = tmp_path / "out" / "events.jsonl"
    events = [orjson.loads(line) for line in events_path.read_text().splitlines()]
    assert sum(e["event"] == "start" for e in events) == SAMPLER_KILLS[sampler] + 1
    # No ready group is generated again: every restore put back all of its bundle's ready groups
    # (stale ones are then evicted, never regenerated), for the gated samplers too.
    restores = [e for e in events if e["event"] == "restore"]
    assert restores and not any(e["shadow"] for e in restores)
    kept = [(e["groups_restored"], ready_in[Path(e["bundle"]).name]) for e in restores
            if Path(e["bundle"]).name in ready_in]
    assert kept and all(restored == ready for restored, ready in kept), kept
    history = effective_history(events)
    steps = [e["step"] for e in history]
    assert steps == list(range(1, k + 4)), "trainer steps are not contiguous"
    consumed = [tuple(p) for e in history for p in e["prompt_ids"]]
    assert len(consumed) == len(set(consumed)), "a prompt was consumed twice in one epoch"
    assert len(consumed) == (k + 3) * GROUPS_PER_STEP

    bundles = layout.finalized_bundles(root)
    for bundle in bundles:
        verify_bundle(bundle)
    last = verify_bundle(bundles[-1])
    assert last.info.step == k + 3
    counts = last.ledger.counts()
    dataloader = last.dataloader
    admitted = dataloader.epoch * PROMPTS + dataloader.cursor
    assert sum(counts.values()) == admitted, "an admitted prompt is missing from the ledger"
    assert counts["consumed"] == len(consumed)
    assert all(e.reason for e in last.ledger.entries().values() if e.state.value == "dropped")
    # What the crashes cost: every restore says what it threw away, and the waste over all processes is small.
    assert all(type(e["stale_tokens"]) is int and e["stale_tokens"] >= 0 for e in restores)
    if sampler == PREFIXES:
        assert sum(e["siblings_resumed"] for e in restores) > 0, "no restore resumed a part-way sibling"
    if sampler == FILTERED:
        print(f"crash loop (filtered): {check_each_constant_prompt_filtered_once_an_epoch(config, consumed, last)} "
              "groups filtered")
    waste = goodput_totals(events_path)
    print(f"crash loop ({sampler}): {SAMPLER_KILLS[sampler]} kills, {admitted} prompts admitted, "
          f"{counts['consumed']} consumed, {counts['dropped']} dropped, final step {k + 3}; ready groups kept "
          f"{sum(r for r, _ in kept)} of {sum(b for _, b in kept)} over {len(kept)} restores; waste "
          f"{waste.waste_ratio:.4f} of {waste.generated_tokens} tokens generated over {waste.runs} runs (restores "
          f"threw away {waste.restore_stale_groups} stale groups, {waste.restore_stale_tokens} tokens)")
    assert waste.waste_ratio <= WASTE_LIMIT
