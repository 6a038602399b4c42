"""The package reads bottom-up: no module imports, even inside a function, a module that imports it back."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "labkit"


def import_graph() -> dict[str, set[str]]:
    """{module: the labkit modules it imports anywhere in its source}, from the source alone (nothing runs)."""
    names = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((PKG / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("labkit.")}
            elif isinstance(node, ast.ImportFrom) and node.module == "labkit":  # from labkit import train as T
                deps |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit."):
                deps.add(node.module.split(".")[1])
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_labkit_import_graph_is_acyclic():
    graph = import_graph()
    assert {"env", "bench", "train", "report", "loaders", "loader_bench", "bucketing"} <= set(graph)
    assert "env" in graph["bench"] and "loaders" in graph["loader_bench"]  # the parser sees real imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def dotted_graph(pkg: str) -> dict[str, set[str]]:
    """{dotted module: the modules of `pkg` (subpackages included) it imports anywhere}, from the source alone."""
    base = PKG.parent / pkg
    mods = {}
    for p in base.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for m, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module in mods and not node.level:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
        graph[m] = deps - {m, pkg}  # the package's own __init__ re-exports nothing the modules need
    return graph


def test_autograder_import_graph_is_acyclic():
    """The grader's phases import one way (a function-level import counts too)."""
    graph = dotted_graph("autograder")
    assert "autograder.intake.submissions" in graph and "autograder.intake.lmsnames" in graph["autograder.intake.submissions"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_errors_and_outputs_import_no_torch():
    """The command line catches LabkitError and checks output paths before torch is loaded."""
    for name in ("errors", "outputs", "progress", "cli"):
        tree = ast.parse((PKG / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy", "matplotlib")}, name


def test_labkit_with_its_fast_start_imports_without_a_cycle():
    """labkit.faststart counted too (a function-level import as well): it may import the core, which never imports
    it back but through train."""
    graph = dotted_graph("labkit")
    assert {"labkit.faststart", "labkit.faststart.tiered", "labkit.faststart.warmstart"} <= set(graph)
    assert "labkit.faststart.precompiled" in graph["labkit.faststart.tiered"]  # the parser sees its imports
    assert "labkit.train" in graph["labkit.faststart.warmstart"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_only_train_reaches_the_fast_start_and_only_through_its_entry_points():
    """The course's modules never import labkit.faststart; train imports the package alone (no submodule) and uses
    only the names in its __all__; cli names its command's module as a string, imported when that command runs."""
    graph = dotted_graph("labkit")
    fast = {m for m in graph if m == "labkit.faststart" or m.startswith("labkit.faststart.")}
    for m, deps in graph.items():
        if m not in fast and m != "labkit.train":
            assert not deps & fast, (m, deps & fast)
    assert graph["labkit.train"] & fast == {"labkit.faststart"}
    init = ast.parse((PKG / "faststart" / "__init__.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in init.body
                    if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    used = {n.attr for n in ast.walk(ast.parse((PKG / "train.py").read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "faststart"}
    assert "start" in used and used <= set(exported), used - set(exported)
    from labkit.cli import COMMANDS

    assert COMMANDS["compile-cache"].module == "labkit.faststart.warmstart"


def test_importing_the_fast_start_starts_nothing():
    """No thread, no child process at import: `start` begins the work when a run calls it."""
    import subprocess
    import sys

    code = ("import threading, labkit.faststart, labkit.faststart.warmstart, multiprocessing\n"
            "assert threading.active_count() == 1, threading.enumerate()\n"
            "assert not multiprocessing.active_children()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
