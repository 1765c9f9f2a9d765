"""Writing bench figures into bench/results/summary.json, each with the commit it was measured at, and
finding the figures whose code changed since.

A figure is measured by a bench module (``bench.rewards``, ...); its code is that module's file and the
paths ``MEASURES`` declares for it.  summary.json keeps each figure's value under its key, as every reader
expects, and under ``"provenance"`` its record: the commit it was measured at (``<sha>-dirty`` when its
code had uncommitted changes then: such a figure measures no commit, so it counts as stale until measured
again on committed code), when, by which module, and whether its code had changed since when the summary
was last written (``checked_at``).  ``python -m bench.summary --stale`` checks against HEAD now.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import anyio
import orjson

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SUMMARY = RESULTS / "summary.json"
PROVENANCE = "provenance"
DIRTY = "-dirty"

# Whole-controller runs on configs/tiny.toml: every part of scd is in the path they time.
_CONTROLLER = ("scd", "configs/tiny.toml", "bench/configs.py", "bench/commits.py")
_TRAINER = ("scd/training", "scd/model", "scd/config.py", "scd/records.py")
# Besides its own file, the code each bench module measures; a figure is stale once any of it changes.
MEASURES: dict[str, tuple[str, ...]] = {
    "bench.run": _CONTROLLER,
    "bench.recovery": _CONTROLLER,
    "bench.goodput": _CONTROLLER,
    "bench.cluster": _CONTROLLER,
    "bench.engines": (*_CONTROLLER, "configs/vllm-cpu.toml"),
    "bench.rewards": _CONTROLLER,
    "bench.evaluation": _CONTROLLER,
    "bench.trainer_group": _TRAINER,
    "bench.trainer_memory": (*_TRAINER, "scd/checkpoint"),
    "bench.trainer_state": _TRAINER,
}


def sources(bench: str) -> tuple[str, ...]:
    """The paths (relative to the repository) whose changes make ``bench``'s figures stale."""
    if bench not in MEASURES:
        raise KeyError(f"bench.summary: {bench} is not in MEASURES; declare the code it measures")
    return (bench.replace(".", "/") + ".py", *MEASURES[bench])


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Measured:
    """Where one figure came from."""

    commit: str  # the HEAD it was measured at; "<sha>-dirty" if its code had uncommitted changes
    measured_at: str  # UTC, ISO 8601
    bench: str  # the module that measured it (a key of MEASURES)
    stale: bool = False  # its code changed after `commit`, as of the summary's `checked_at`
    superseded: str = ""  # why the figure does not measure what its name says (until measured again)


@dataclass(frozen=True)
class WorkTree:
    """HEAD and the paths with uncommitted changes, read once as a bench run starts (the code it loads)."""

    head: str
    changed: frozenset[str]
    read_at: str

    @classmethod
    def read(cls, repo: Path) -> WorkTree:
        # -z: each entry "XY path" NUL-terminated, the path unquoted whatever characters it holds.
        status = git(repo, "status", "--porcelain", "-z", "--untracked-files=all", "--no-renames")
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        changed = frozenset(entry[3:] for entry in status.split("\0") if entry)
        return cls(git(repo, "rev-parse", "HEAD").strip(), changed, now)

    def measured(self, bench: str) -> Measured:
        dirty = any(path == source or path.startswith(source + "/")
                    for path in self.changed for source in sources(bench))
        return Measured(self.head + (DIRTY if dirty else ""), self.read_at, bench)


@functools.cache
def work_tree() -> WorkTree:
    """This process's work tree as first asked for: a bench runner asks before it measures anything."""
    return WorkTree.read(REPO)


def main_module() -> str:
    """The module ``python -m`` ran: the bench whose figures a standalone run writes."""
    spec = sys.modules["__main__"].__spec__
    assert spec is not None, "run benches as `python -m bench.<module>`"
    return spec.name


def bench_module(bench: Callable[..., Any]) -> str:
    return main_module() if bench.__module__ == "__main__" else bench.__module__


def changed_after(record: Measured, repo: Path) -> list[str]:
    """The commits since ``record.commit`` that changed its code, newest first; "uncommitted" leads if it
    measured uncommitted code."""
    commit = record.commit.removesuffix(DIRTY)
    changes = git(repo, "log", "--format=%h", f"{commit}..HEAD", "--", *sources(record.bench)).split()
    return (["uncommitted"] if record.commit.endswith(DIRTY) else []) + changes


def stale_figures(figures: Mapping[str, Measured], repo: Path) -> dict[str, list[str]]:
    """Each figure whose code changed after it was measured, with what changed it (one git log per
    commit and module, not per figure)."""
    by_origin = {(r.commit, r.bench): changed_after(r, repo) for r in figures.values()}
    return {key: by_origin[r.commit, r.bench] for key, r in figures.items() if by_origin[r.commit, r.bench]}


def load(path: Path) -> tuple[dict[str, Any], dict[str, Measured]]:
    """The summary's figures (and its meta) and their records."""
    summary = orjson.loads(path.read_bytes()) if path.exists() else {}
    provenance = summary.pop(PROVENANCE, {"figures": {}})
    return summary, {key: Measured(**record) for key, record in provenance["figures"].items()}


def write(measured: Mapping[str, Mapping[str, float]], tree: WorkTree, path: Path = SUMMARY, repo: Path = REPO,
          meta: dict[str, Any] | None = None) -> None:
    """``measured`` (figures by the bench module that measured them) into the summary at ``path``, each
    recorded at ``tree``; every other figure and its record kept.  With ``meta`` (a full run), the summary
    starts over with it; otherwise the last full run's meta stays.  Then every figure's ``stale`` is
    checked against ``repo``'s HEAD."""
    summary, figures = ({}, {}) if meta is not None else load(path)
    if meta is not None:
        summary["meta"] = meta
    for bench, values in measured.items():
        summary |= values
        figures |= dict.fromkeys(values, tree.measured(bench))
    stale = stale_figures(figures, repo)
    records = {key: asdict(replace(record, stale=key in stale)) for key, record in figures.items()}
    provenance = {"checked_at": git(repo, "rev-parse", "HEAD").strip(), "figures": records}
    path.write_bytes(orjson.dumps({**summary, PROVENANCE: provenance}, option=orjson.OPT_INDENT_2))


async def probe_loop(stalls: list[float]) -> None:
    """How late the loop wakes a 10 ms sleep, appended to ``stalls`` until cancelled."""
    while True:
        before = time.monotonic()
        await anyio.sleep(0.01)
        stalls.append(time.monotonic() - before - 0.01)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def merge_and_print(summary: dict[str, float], goals: dict[str, tuple[str, float]]) -> None:
    """Add ``summary``'s keys, measured by the module ``python -m`` ran, to the committed summary (every other
    key kept) and print each against its goal."""
    write({main_module(): summary}, work_tree())
    for key, value in summary.items():
        mark = ""
        if key in goals:
            op, bound = goals[key]
            mark = f"{op} {bound:g}  {'met' if (value >= bound if op == '>=' else value <= bound) else 'MISSED'}"
        print(f"{key:52s} {value:14.4f}  {mark}")


Bench = Callable[[Path], Awaitable[dict[str, float]]]


async def run_standalone(benches: Sequence[tuple[str, Bench]], goals: dict[str, tuple[str, float]]) -> None:
    """``python -m bench.<module>``: ``benches`` on a Ray and TQ of their own, in a scratch directory under
    bench/, their figures merged into the committed summary and printed against ``goals``."""
    import ray
    import transfer_queue as tq

    work_tree()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.2",
             logging_level=logging.WARNING)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    summary: dict[str, float] = {}
    try:
        with TemporaryDirectory(dir=RESULTS.parent) as tmp_name:
            for name, bench in benches:
                started = time.monotonic()
                summary |= await bench(Path(tmp_name))
                print(f"[{name}: {time.monotonic() - started:.0f}s]", flush=True)
    finally:
        tq.close()
        ray.shutdown()
    merge_and_print(summary, goals)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.summary")
    parser.add_argument("--stale", action="store_true", required=True,
                        help="list the committed figures whose code changed after they were measured; exit 1 if any")
    parser.parse_args()
    _, figures = load(SUMMARY)
    stale = stale_figures(figures, REPO)
    for key, changes in stale.items():
        shown = ", ".join(changes[:5]) + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")
        print(f"{key}: measured at {figures[key].commit[:12]} by {figures[key].bench}; changed since: {shown}")
    print(f"{len(stale)} of {len(figures)} figures stale at HEAD")
    raise SystemExit(1 if stale else 0)


if __name__ == "__main__":
    main()
