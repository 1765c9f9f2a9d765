"""The package's shape, measured: layers only import downwards, no import circles, the daemon stays
wiring, and tests and bench go through public surfaces."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "scd"
# The layering documented at the top of scd/__init__.py, bottom to top.
LAYERS: dict[str, int] = {
    "config": 1, "errors": 1, "records": 1, "tasks": 1, "faults": 1, "triggers": 1,
    "ledger": 2, "replay": 2, "skew": 2, "samplers": 2, "dataloader": 2, "barrier": 2, "schema": 2, "state": 2,
    "model": 3,
    "cluster": 4, "dataplane": 4, "training": 4, "generation": 4, "telemetry": 4, "rewards": 4, "systemd": 4,
    "reaper": 4,
    "rollouts": 5, "scoring": 5, "goodput": 5, "risk": 5,
    "checkpoint": 6, "evaluation": 6,
    "daemon": 7, "watch": 7,
    "cli": 8, "report": 8,
}
DAEMON_MAX_LINES = 350


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, packages: tuple[str, ...]) -> set[str]:
    """Every module of ``packages`` that ``path`` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] in packages)
    return found


def import_graph(packages: tuple[str, ...] = ("scd",)) -> dict[str, set[str]]:
    modules = {module_name(p): p for package in packages for p in (REPO / package).rglob("*.py")}
    return {name: {m for m in imports_of(path, packages) if m in modules and m != name}
            for name, path in modules.items()}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_a_layer_above_it() -> None:
    graph = import_graph()
    unplaced = sorted(m for m in graph if m != "scd" and layer_of(m) is None)
    assert not unplaced, f"modules with no layer in scd/__init__.py's docstring: {unplaced}"
    upward = sorted((m, i) for m, imports in graph.items() for i in imports
                    if m != "scd" and (layer_of(i) or 0) > (layer_of(m) or 0))
    assert upward == []


def test_no_import_circles() -> None:
    packages = ("scd", "bench")
    graph = import_graph(packages)
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append([*path[path.index(module):], module])
            return
        if module in done:
            return
        for imported in graph.get(module, ()):
            if imported not in packages:
                visit(imported, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])
    assert "bench.configs" in graph["bench.run"]  # the walk sees bench's imports too
    assert circles == []


def test_the_daemon_is_wiring_and_rollouts_never_reach_up() -> None:
    assert len((PACKAGE / "daemon.py").read_text().splitlines()) <= DAEMON_MAX_LINES
    rollouts_imports = imports_of(PACKAGE / "rollouts.py", ("scd",))
    assert not any(i.startswith(("scd.daemon", "scd.checkpoint")) for i in rollouts_imports)


def scd_private_attributes() -> set[str]:
    """Every ``self._name`` scd's own classes define (another package's privates are not ours to police)."""
    return {node.attr for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr.startswith("_") and not node.attr.startswith("__")}


def private_reads(path: Path, private: set[str]) -> list[str]:
    """``x._name`` for one of scd's private attributes, where ``x`` is not the object itself."""
    return [f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})]


def test_tests_and_bench_read_no_private_attribute() -> None:
    private = scd_private_attributes()
    assert "_finished" in private  # the check sees what it polices
    reads = [r for folder in ("tests", "bench") for p in sorted((REPO / folder).rglob("*.py"))
             for r in private_reads(p, private)]
    assert reads == []


# A document outside the repository, or an issue by number: a reader of the repository cannot follow either.
UNREACHABLE = re.compile(r"DESIGN\.md|DESIGN §|(?<![\w/])shared/\w+[./]|\bissues? #?\d+|(?<![\w&/])#\d+\b",
                         re.IGNORECASE)
RELATIVE_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)#\s]+)[^)]*\)")


def test_no_reference_to_a_document_the_repository_does_not_hold() -> None:
    cited = [f"{p.relative_to(REPO)}" for p in PACKAGE.rglob("*.py") if "DESIGN §" in p.read_text()]
    assert cited == []
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(documents) > 1
    cited = [f"{p.relative_to(REPO)}: {m.group()}" for p in documents for m in UNREACHABLE.finditer(p.read_text())]
    assert cited == []
    missing = [f"{p.relative_to(REPO)}: {target}" for p in documents for target in RELATIVE_LINK.findall(p.read_text())
               if not (p.parent / target).exists()]
    assert missing == []


def test_generation_and_training_meet_only_in_the_model_room() -> None:
    graph = import_graph()
    def room(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    sideways = sorted((m, i) for m, imports in graph.items() for i in imports
                      if {room(m), room(i)} == {"generation", "training"})
    assert sideways == []
