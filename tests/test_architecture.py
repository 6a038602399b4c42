"""ARCHITECTURE.md's map of the grader is the source's: every module in one phase, imports pointing one way.

The table's rows list the phases in order; a module may import its own phase and the phases above it. The
imports that still point down the table are listed under it, and only those may: a new one fails here, and
fixing one means taking it off the list.
"""

import re
from pathlib import Path

from test_imports import dotted_graph

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"


def phases() -> dict[str, list[str]]:
    """phase -> its modules, in the table's order."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("phase", "---") and line.startswith("|"):
            out[cells[0]] = [m.strip().replace("\\_", "_") for m in cells[1].split(",")]
    return out


def exceptions() -> set[tuple[str, str]]:
    """(module, module) pairs of the listed imports that point down the table."""
    text = DOC.read_text()
    return set(re.findall(r"^- `(\w+) -> (\w+)`", text, re.M))


def test_every_grader_module_is_in_one_phase_of_the_map():
    table = phases()
    assert list(table)[:3] == ["base", "sandbox", "intake"] and "gradebook" in table
    named = [m for mods in table.values() for m in mods]
    assert len(named) == len(set(named)), "a module is named in two phases"
    modules = {p.stem for p in (ROOT / "autograder").glob("*.py")} - {"__init__"}
    assert modules - set(named) == set(), f"autograder modules missing from ARCHITECTURE.md: {modules - set(named)}"
    assert set(named) - modules == set(), f"ARCHITECTURE.md names modules that do not exist: {set(named) - modules}"


def test_imports_point_up_the_map_except_the_listed_ones():
    table = phases()
    rank = {m: i for i, mods in enumerate(table.values()) for m in mods}
    down = set()
    for mod, deps in dotted_graph("autograder").items():
        a = mod.split(".")[-1]
        if mod.startswith("autograder.student") or a not in rank:
            continue
        for d in deps:
            b = d.split(".")[-1]
            if not d.startswith("autograder.student") and b in rank and rank[b] > rank[a]:
                down.add((a, b))
    assert down <= exceptions(), f"imports from a phase to a later one, not listed in ARCHITECTURE.md: {down - exceptions()}"
    assert exceptions() <= down, f"listed in ARCHITECTURE.md but gone from the source: {exceptions() - down}"


def test_the_sandboxed_half_imports_nothing_trusted():
    """autograder/student runs beside the student's code: it may import itself, labkit and torch, nothing else of
    the grader (a trusted module there would be readable, and patchable, by the student)."""
    for mod, deps in dotted_graph("autograder").items():
        if mod.startswith("autograder.student"):
            trusted = {d for d in deps if not d.startswith("autograder.student")}
            assert not trusted, f"{mod} imports trusted modules {trusted}"
