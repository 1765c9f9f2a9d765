"""A drain (SIGTERM) keeps every completion it scored: the final bundle holds each scored sibling (trained,
ready, or finished in flight with its score), so the restored run neither generates nor scores it again."""

from __future__ import annotations

import signal
from pathlib import Path

import orjson

from scd.checkpoint import layout
from scd.skew import Fate
from tests.conftest import ScdProcess, write_config

ROWS = 64
# Counts each call in its own file (one per reward process: appends from several processes never interleave).
COUNTING = """
import os
from pathlib import Path

def reward(prompt, completion, answer, row):
    with (Path(__file__).parent / f"scored-{os.getpid()}.log").open("a") as out:
        out.write("x")
    return sum(a == b for a, b in zip(completion, answer)) / len(answer)
"""


def scored_calls(directory: Path) -> int:
    return sum(len(p.read_text()) for p in directory.glob("scored-*.log"))


def test_a_sigterm_drain_keeps_every_scored_sibling_in_its_final_bundle(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str) -> None:
    dataset = tmp_path / "train.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps({"prompt": f"{k * 37 % 10_000:04d}",
                                               "answer": f"{k * 37 % 10_000:04d}"[::-1]}) + b"\n"
                                 for k in range(ROWS)))
    (tmp_path / "counting.py").write_text(COUNTING)
    config = write_config(tmp_path, ray_address=session_ray, max_steps=100_000, extra=(
        '\n[[task.rewards]]\nfunction = "counting.py:reward"\nname = "digits"\n'
        "\n[checkpointing]\nenabled = true\ninterval_s = 3600\n"))
    config.write_text(config.read_text().replace('name = "reverse"\nsize = 64\n',
                                                 f'name = "jsonl"\npath = "{dataset}"\n'))
    # No sibling goes stale: every score the run paid for is one a bundle can keep.
    scd = ScdProcess(config, "--set", "async_rl.sampler.max_staleness_versions=1000",
                     "--set", "async_rl.buffer_capacity_groups=32")
    scd_processes.append(scd)
    scd.wait_for_line("step 3 ", timeout=300)
    scd.signal(signal.SIGTERM)
    assert scd.wait(timeout=300) == 0, scd.output()[-3000:]

    bundle = layout.finalized_bundles(tmp_path / "out" / "checkpoints")[-1]
    info = orjson.loads((bundle / layout.TRAINING_INFO_FILE).read_bytes())
    sidecar = orjson.loads((bundle / layout.SIDECAR_FILE).read_bytes())
    assert info["trigger"] == "shutdown"
    fates = {fate: sum(c.get(fate, 0) for c in sidecar["prompt_fates"].values()) for fate in Fate}
    assert fates[Fate.DROPPED_STALE] == fates[Fate.EVICTED] == 0
    # Scored and held: each trained group's siblings, each ready group's, and the scored siblings in flight.
    held = info["group_size"] * (fates[Fate.TRAINED] + info["groups"]) + len(sidecar["sibling_scores"])
    assert scored_calls(tmp_path) == held, (fates[Fate.TRAINED], info["groups"], len(sidecar["sibling_scores"]))
