"""Every course notebook: follows the conventions (badge, setup cell, no outputs) and runs top to bottom on CPU."""

import os

import pytest

from labkit import notebooks

NOTEBOOKS = notebooks.notebook_paths()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_conventions(path):
    assert notebooks.problems(path) == []


def test_badge_check_catches_wrong_path(tmp_path):
    import shutil

    if not NOTEBOOKS:
        pytest.skip("no notebooks yet")
    root = tmp_path
    (root / "notebooks").mkdir()
    shutil.copy(notebooks.REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    copy = root / "notebooks" / "renamed.ipynb"
    shutil.copy(NOTEBOOKS[0], copy)
    assert any("Colab badge" in p for p in notebooks.problems(copy, root))
    notebooks.fix(copy, root)
    assert notebooks.problems(copy, root) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_on_cpu(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_backup = dict(os.environ)
    os.environ.update(LABKIT_QUICK="1", MPLBACKEND="Agg", TQDM_DISABLE="1")
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()  # what it writes lands there
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
