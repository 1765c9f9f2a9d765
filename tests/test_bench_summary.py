"""bench/results/summary.json records, per figure, the commit it was measured at, and a figure whose code
changed after that commit is found stale: on a git repository of the test's own, so the figures committed
today being stale (or not) never fails the suite."""

from __future__ import annotations

from pathlib import Path

import orjson

from bench.render_performance import Reading, origin
from bench.summary import MEASURES, PROVENANCE, SUMMARY, WorkTree, git, load, sources, stale_figures, write
from tests.conftest import REPO


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def test_each_figure_keeps_the_commit_it_was_measured_at_and_goes_stale_when_its_code_changes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    first = commit(repo, {"bench/run.py": "", "bench/trainer_memory.py": "", "scd/training/grpo.py": "v1",
                          "scd/rewards/pool.py": "v1"}, "first")
    path = repo / "summary.json"
    write({"bench.run": {"commit_path_groups_per_s": 1.0}, "bench.trainer_memory": {"trainer_ratio": 0.2}},
          WorkTree.read(repo), path, repo, meta={"cpus": 2})
    summary, figures = load(path)
    assert summary == {"meta": {"cpus": 2}, "commit_path_groups_per_s": 1.0, "trainer_ratio": 0.2}
    assert {key: (r.commit, r.bench, r.stale) for key, r in figures.items()} == {
        "commit_path_groups_per_s": (first, "bench.run", False),
        "trainer_ratio": (first, "bench.trainer_memory", False)}

    # The reward pool is in what bench.run measures (the whole controller), not in the trainer's figures.
    second = commit(repo, {"scd/rewards/pool.py": "v2"}, "second")
    assert stale_figures(figures, repo) == {"commit_path_groups_per_s": [second[:7]]}
    third = commit(repo, {"scd/training/grpo.py": "v2"}, "third")
    assert stale_figures(figures, repo) == {"commit_path_groups_per_s": [third[:7], second[:7]],
                                            "trainer_ratio": [third[:7]]}
    commit(repo, {"README.md": "unmeasured"}, "fourth")
    assert stale_figures(figures, repo).keys() == {"commit_path_groups_per_s", "trainer_ratio"}

    # A partial run replaces its own figures and records; the others keep theirs, and the meta of the full run.
    head = git(repo, "rev-parse", "HEAD").strip()
    write({"bench.run": {"commit_path_groups_per_s": 3.0}}, WorkTree.read(repo), path, repo)
    summary, figures = load(path)
    assert summary == {"meta": {"cpus": 2}, "commit_path_groups_per_s": 3.0, "trainer_ratio": 0.2}
    assert {key: (r.commit, r.stale) for key, r in figures.items()} == {
        "commit_path_groups_per_s": (head, False), "trainer_ratio": (first, True)}
    assert orjson.loads(path.read_bytes())[PROVENANCE]["checked_at"] == head

    # A change elsewhere in the tree (the summary itself, a file the figure does not measure) is not its code.
    (repo / "README.md").write_text("uncommitted")
    (repo / "bench/run.py").write_text("# uncommitted")
    assert WorkTree.read(repo).measured("bench.trainer_memory").commit == head
    # Measured with its code changed and not committed: "-dirty", stale until measured again on a commit.
    (repo / "scd/training/grpo.py").write_text("v3")
    write({"bench.trainer_memory": {"trainer_ratio": 0.3}}, WorkTree.read(repo), path, repo)
    _, figures = load(path)
    assert figures["trainer_ratio"].commit == f"{head}-dirty"
    assert stale_figures(figures, repo) == {"trainer_ratio": ["uncommitted"]}


def test_every_committed_figure_has_a_record_of_a_commit_in_this_history_and_a_declared_code() -> None:
    summary, figures = load(SUMMARY)
    assert figures.keys() == summary.keys() - {"meta"}
    for commit in {record.commit.removesuffix("-dirty") for record in figures.values()}:
        git(REPO, "cat-file", "-e", f"{commit}^{{commit}}")
    assert {record.bench for record in figures.values()} <= MEASURES.keys()
    for bench in MEASURES:
        assert all((REPO / path).exists() for path in sources(bench)), bench


def test_a_row_shows_its_figures_commits_and_a_superseded_figure_is_not_met() -> None:
    summary = {"a": 1.0, "b": 2.0, "c": 3.0, PROVENANCE: {"checked_at": "f" * 40, "figures": {
        "a": {"commit": "1" * 40, "measured_at": "2026-12-01T00:00:00+00:00", "bench": "bench.run"},
        "b": {"commit": "2" * 40 + "-dirty", "measured_at": "2026-12-02T00:00:00+00:00", "bench": "bench.run",
              "stale": True},
        "c": {"commit": "3" * 40, "measured_at": "2026-12-03T00:00:00+00:00", "bench": "bench.run",
              "superseded": "measured something easier."}}}}
    reading = Reading(summary)
    assert reading["a"] == 1.0
    assert origin(reading, "met") == ("`1111111` 2026-12-01", "met")
    assert reading["b"] == 2.0
    assert origin(reading, "met") == ("`1111111` 2026-12-01, `2222222-dirty` 2026-12-02, stale", "met")
    reading = Reading(summary)
    assert reading["c"] == 3.0
    assert origin(reading, "met") == ("`3333333` 2026-12-03; superseded: measured something easier.", "superseded")
