import os

import pytest

# Tests run the quick, CPU-sized variants of everything, and never open a plot window.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def tmp_results(tmp_path):
    """A private results folder, so tests never write into benchmarks/results/."""
    d = tmp_path / "results"
    d.mkdir()
    return d
