"""The documents say what the code does: every config key, every metric, every phase, a performance page
rendered from the committed results, and links that lead somewhere. No Ray is started here."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
from prometheus_client import REGISTRY

import scd.telemetry.metrics  # noqa: F401  (registers every family scd exports)
from bench.render_performance import DOC, render_committed
from scd.config import Config
from scd.schema import CheckpointPhase, RestorePhase
from tests.conftest import REPO

DOCS = REPO / "docs"
README_MAX_LINES = 200
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAME = re.compile(r"`([^`]+)`")


def config_keys(info: msgspec.inspect.StructType, prefix: str = "") -> list[str]:
    """Every ``section.key`` path of the config, nested sections walked down to their leaves."""
    keys: list[str] = []
    for field in info.fields:
        path = f"{prefix}{field.encode_name}"
        if isinstance(field.type, msgspec.inspect.StructType):
            keys += config_keys(field.type, f"{path}.")
        else:
            keys.append(path)
    return keys


def section(doc: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    start = doc.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(r"^(#+) ", doc[start + 1:], re.MULTILINE)
            if len(m.group(1)) <= len(level)][1:]
    return doc[start:start + 1 + ends[0]] if ends else doc[start:]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every markdown table in ``text``, as cells."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| `")]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_reads_in_five_minutes() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_every_config_key_is_documented() -> None:
    keys = config_keys(msgspec.inspect.type_info(Config))
    assert "generation.vllm.weight_sync" in keys and "telemetry.wandb.mode" in keys  # the walk reaches leaves
    documented = {row[0].strip("`") for row in table_rows((DOCS / "configuration.md").read_text())}
    assert [key for key in keys if key not in documented] == []
    assert sorted(documented - set(keys)) == []


def test_the_metrics_table_is_the_registry() -> None:
    registered = {(f"{m.name}_total" if m.type == "counter" else m.name, m.type)
                  for m in REGISTRY.collect() if m.name.startswith("scd_")}
    assert ("scd_generation_tokens_total", "counter") in registered  # counters read as exported
    metrics = section((DOCS / "operations.md").read_text(), "## Metrics")
    documented = {(name, row[1]) for row in table_rows(metrics) for name in NAME.findall(row[0])}
    assert sorted(registered - documented) == []
    assert sorted(documented - registered) == []


def test_the_phase_tables_name_every_phase() -> None:
    doc = (DOCS / "checkpoints.md").read_text()
    for heading, phases in (("## Checkpoint phases", CheckpointPhase), ("## Restore phases", RestorePhase)):
        documented = [row[0].strip("`") for row in table_rows(section(doc, heading))]
        assert sorted(documented) == sorted(phase.value for phase in phases), heading
    restore_order = [row[0].strip("`") for row in table_rows(section(doc, "## Restore phases"))]
    assert restore_order == [phase.value for phase in RestorePhase]  # the order restore runs them


def test_the_performance_page_is_what_the_committed_results_render() -> None:
    assert DOC.read_text() == render_committed(), "run `python -m bench.render_performance` and commit the doc"


def test_every_link_to_a_heading_finds_it() -> None:
    documents = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    anchors = {path: {slug(h) for h in HEADING.findall(path.read_text())} for path in documents}
    broken: list[str] = []
    for path in documents:
        for target in LINK.findall(path.read_text()):
            if "#" not in target or target.startswith(("http://", "https://")):
                continue
            file, anchor = target.split("#", 1)
            linked = (path.parent / file).resolve() if file else path
            if anchor not in anchors.get(Path(linked), set()):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert broken == []


def number_rows(text: str) -> list[dict[str, str]]:
    """The rows of the one markdown table in ``text`` whose first cell is a number, by column name."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    columns = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(columns, (cell.strip().strip("*") for cell in line.strip("|").split("|")), strict=True))
            for line in lines[2:] if line.strip("|").split("|")[0].strip().isdigit()]


def test_the_own_task_examples_generalisation_claim_is_its_tables_numbers() -> None:
    """The held-out prose quotes the last rows of both tables and the gap between them, so a claim the
    numbers do not carry (``learned the task, not its training prompts``) cannot come back unnoticed."""
    curve = section((DOCS / "own-task.md").read_text(), "## The example's learning curve")
    held_out_section = section(curve, "### On the held-out prompts")
    training = curve[:curve.index("### On the held-out prompts")]
    trained, held_out = number_rows(training)[-1], number_rows(held_out_section)[-1]
    prose = " ".join(held_out_section.split("![")[1].split())
    digits_gap = float(trained["digits"]) - float(held_out["digits"])
    reward_gap = float(trained["reward"]) - float(held_out["eval reward"])
    assert f"held-out {held_out['digits']} against {trained['digits']} on its 256 training prompts, " \
           f"a gap of {digits_gap:.2f}" in prose
    assert f"{held_out['eval reward']} against {trained['reward']} in training, a gap of {reward_gap:.3f}" in prose
    assert f"pass@1 is {held_out['pass@1']}" in prose
