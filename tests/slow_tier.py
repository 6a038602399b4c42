"""Which tests `make check` (the fast tier) leaves to `make test`: the ids listed in tests/slow_tests.txt.

A listed id is a test file (`tests/test_x.py`), a test function (`tests/test_x.py::test_y`, every parameter of
it) or one parametrized case (`tests/test_x.py::test_y[case]`). conftest.py marks each collected test that a line
names `slow`; `make check` runs `pytest -m "not slow"`, `make test` everything.

The list is measured, not guessed. After a whole run that wrote a JUnit file
(`python -m pytest --junitxml=junit.xml`), rewrite it with

    python tests/slow_tier.py junit.xml

which lists every test that took at least SLOW_S seconds on that machine, a whole file where most of the
file's time is in such tests. A test new since the list was made counts as fast until the list is remade.

A whole run charges a shared fixture (a course generated once, a release built once) to the first test that asks
for it, often a slow one; run alone, the fast tier pays for it in a fast test. So measure the fast tier itself too
(`python -m pytest -m "not slow" --junitxml=fast.xml`) and add what is slow there:

    python tests/slow_tier.py --add fast.xml

Where a module's shared fixture is what costs (a graded class, a built release), every fast test of it pays in
turn as the one before joins the list: such a file is listed whole, by hand, at the end of the list.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

LIST = Path(__file__).with_name("slow_tests.txt")
SLOW_S = 2.0  # a test at least this long (seconds, on the machine that made the list) goes to the slow tier
WHOLE_FILE = 0.8  # a file whose slow tests hold this share of its time is listed whole


def listed(path: Path = LIST) -> list[str]:
    """The ids in the list file, comments and blank lines left out."""
    if not path.exists():
        return []
    return [s for line in path.read_text().splitlines() if (s := line.split("#", 1)[0].strip())]


def is_listed(nodeid: str, ids: list[str]) -> bool:
    """Whether `nodeid` (pytest's, relative to the repository) is named by one of `ids`."""
    return any(nodeid == i or nodeid.startswith(i + "::") or nodeid.startswith(i + "[") for i in ids)


def _durations(junit: Path) -> dict[str, float]:
    """nodeid -> seconds, from a JUnit XML file pytest wrote (classname 'tests.test_x', name 'test_y[case]')."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        module = case.get("classname", "").replace(".", "/")
        out[f"{module}.py::{case.get('name')}"] = float(case.get("time", 0))
    return out


def choose(durations: dict[str, float]) -> list[str]:
    """The ids to list: whole files where slow tests hold most of the time, else the slow functions."""
    files, chosen = defaultdict(dict), []
    for nodeid, s in durations.items():
        files[nodeid.split("::")[0]][nodeid] = s
    for f, tests in sorted(files.items()):
        slow = {n: s for n, s in tests.items() if s >= SLOW_S}
        if not slow:
            continue
        if sum(slow.values()) >= WHOLE_FILE * sum(tests.values()) and len(slow) >= len(tests) / 2:
            chosen.append(f)
            continue
        chosen.extend(sorted({n.split("[")[0] for n in slow}))
    return chosen


def add(junit: Path, path: Path = LIST) -> list[str]:
    """Add to the list the tests of a fast-tier run (`-m "not slow"`) that took SLOW_S seconds or more there;
    the ids added, by function (a file is listed whole only from a whole run)."""
    ids = listed(path)
    new = sorted({n.split("[")[0] for n, s in _durations(junit).items() if s >= SLOW_S and not is_listed(n, ids)})
    fast = sum(s for n, s in _durations(junit).items() if not is_listed(n, ids + new))
    text = path.read_text() if path.exists() else ""
    path.write_text(text + (f"# Added from a fast-tier run: the rest of it took {fast:.0f} s there.\n" if new else "")
                    + "".join(f"{i}\n" for i in new))
    return new


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--add" and Path(argv[1]).is_file():
        new = add(Path(argv[1]))
        print(f"{LIST}: {len(new)} ids added")
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python tests/slow_tier.py JUNIT.xml   (a JUnit file from a whole pytest run)\n"
              "       python tests/slow_tier.py --add FAST.xml   (from a run of the fast tier alone)", file=sys.stderr)
        return 2
    durations = _durations(Path(argv[0]))
    ids = choose(durations)
    fast = sum(s for n, s in durations.items() if not is_listed(n, ids))
    header = (f"# The slow tier: tests `make check` skips and `make test` runs (tests/slow_tier.py says how this list "
              f"is made).\n# Made from a whole run: {len(durations)} tests, {sum(durations.values()):.0f} s; the "
              f"rest, the fast tier, took {fast:.0f} s of it.\n")
    LIST.write_text(header + "".join(f"{i}\n" for i in ids))
    print(f"{LIST}: {len(ids)} ids; fast tier {fast:.0f} s of {sum(durations.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
