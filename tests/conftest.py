import importlib.util
import os
from pathlib import Path

import pytest

# Tests run the quick, CPU-sized variants of everything, and never open a plot window.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Tests grade on the public open-kit default (autograder.base.course_secret): its hidden cases are fixed, and lab 3's
# reference solution answers the repository's own slow_train.py. A secret in the developer's shell stays out.
os.environ.pop("LABKIT_COURSE_SECRET", None)
os.environ["LABKIT_OPEN_KIT"] = "1"


@pytest.fixture
def tmp_results(tmp_path):
    """A private results folder, so tests never write into benchmarks/results/."""
    d = tmp_path / "results"
    d.mkdir()
    return d


@pytest.fixture
def one_thread():
    """Torch on one intra-op thread for the test: a busy 2-core machine stalls a team of threads far more than one
    thread (10x seen), and real CPU runs are timed."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lines():
    """(got, say): a `say` callback for code that reports in lines, and the list of what it said."""
    got = []
    return got, got.append


@pytest.fixture
def inductor():
    """torch._inductor.config, its compile_threads restored after the test (loading a saved forward sets it)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=inductor_config.compile_threads):
        yield inductor_config


def benchmark_module(name: str):
    """benchmarks/NAME.py imported as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def active_markup(page: str) -> list[str]:
    """Markup in an HTML page that would run a hostile notebook's script: a script or svg element, an event
    handler or a link carrying an alert(...) call. The same text shown as text is fine."""
    from html.parser import HTMLParser

    found, stack = [], []

    class Scan(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if "alert(" in (value or "") and (name.startswith("on") or name in ("href", "src")):
                    found.append(f"<{tag} {name}={value}>")
            if tag not in ("img", "br", "hr", "input", "meta", "link"):  # elements that have no end tag
                stack.append(tag)

        def handle_endtag(self, tag):
            if stack and stack[-1] == tag:
                stack.pop()

        def handle_data(self, data):
            if stack and stack[-1] in ("script", "svg") and "alert(" in data:
                found.append(f"<{stack[-1]}>{data[:60]}")

    Scan().feed(page)
    return found


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: in tests/slow_tests.txt; `make check` skips it, `make test` runs it")


def pytest_collection_modifyitems(config, items):
    spec = importlib.util.spec_from_file_location("slow_tier", Path(__file__).with_name("slow_tier.py"))
    tier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tier)
    ids = tier.listed()
    for item in items:
        if tier.is_listed(item.nodeid, ids):
            item.add_marker(pytest.mark.slow)
