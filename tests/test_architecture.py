"""ARCHITECTURE.md's map of the grader is the source's: one package per phase, imports pointing one way.

The table's rows list the phases in order. A phase's modules live in its package, `autograder/<phase>/`, but for the
two rows at the top of autograder/: the public modules (shipped to the student side at those paths) and the command
line (run). A phase may be imported by itself and the phases below it in the table, never by one above it: no
exceptions.
"""

from pathlib import Path

from test_imports import dotted_graph

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"
TOP_LEVEL = ("public", "run")  # the rows whose modules sit at the top of autograder/


def phases() -> dict[str, list[str]]:
    """phase -> its modules, in the table's order."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("phase", "---") and line.startswith("|"):
            out[cells[0]] = [m.strip().replace("\\_", "_") for m in cells[1].split(",")]
    return out


def _package(phase: str) -> bool:
    return phase not in TOP_LEVEL and (ROOT / "autograder" / phase / "__init__.py").is_file()


def module_phases() -> dict[str, str]:
    """dotted module -> its phase, as the table says (a package's __init__ is its phase's too)."""
    out = {}
    for phase, mods in phases().items():
        prefix = f"autograder.{phase}" if _package(phase) else "autograder"
        out.update({f"{prefix}.{m}": phase for m in mods})
        if _package(phase):
            out[prefix] = phase
    return out


def _trusted_modules() -> set[str]:
    return {m for m in dotted_graph("autograder") if m != "autograder" and not m.startswith("autograder.student")}


def test_every_grader_module_is_in_one_phase_of_the_map():
    table = phases()
    assert list(table) == ["public", "base", "sandbox", "intake", "checks", "gradebook", "lms", "release", "run"]
    named = [f"{phase}/{m}" if _package(phase) else m for phase, mods in table.items() for m in mods]
    assert len(named) == len(set(named)), "a module is named in two phases"
    where, source = module_phases(), _trusted_modules()
    assert source - set(where) == set(), f"autograder modules missing from ARCHITECTURE.md: {source - set(where)}"
    assert set(where) - source == set(), f"ARCHITECTURE.md names modules that do not exist: {set(where) - source}"
    packages = {p.name for p in (ROOT / "autograder").iterdir() if (p / "__init__.py").is_file()} - {"student"}
    assert packages == set(table) - set(TOP_LEVEL), f"one package per phase: {packages ^ (set(table) - set(TOP_LEVEL))}"


def test_each_phase_is_imported_only_by_itself_and_the_phases_below_it():
    """The one rule of every package: who may import it. A function-level import counts too."""
    rank = {p: i for i, p in enumerate(phases())}
    where = module_phases()
    up = set()
    for mod, deps in dotted_graph("autograder").items():
        if mod == "autograder" or mod.startswith("autograder.student"):
            continue
        for d in deps:
            if not d.startswith("autograder.student") and rank[where[d]] > rank[where[mod]]:
                up.add(f"{mod} ({where[mod]}) -> {d} ({where[d]})")
    assert not up, f"imports of a phase below the importer's in ARCHITECTURE.md: {sorted(up)}"


def test_the_sandboxed_half_imports_nothing_trusted():
    """autograder/student runs beside the student's code: it may import itself, labkit and torch, nothing else of
    the grader (a trusted module there would be readable, and patchable, by the student)."""
    for mod, deps in dotted_graph("autograder").items():
        if mod.startswith("autograder.student"):
            trusted = {d for d in deps if not d.startswith("autograder.student")}
            assert not trusted, f"{mod} imports trusted modules {trusted}"
