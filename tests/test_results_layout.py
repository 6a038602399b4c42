"""benchmarks/results/ by topic and docs/results/ by page: every record sits in a topic folder, names stay unique
(so a record is found by name), and each topic page is short and cites only current records."""

import re
from pathlib import Path

import pytest

from labkit import bench
from labkit.env import LabkitError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ROOT / "docs" / "results"
TOPICS = {"ladder", "coldstart", "grading", "ddp", "kernels", "notebooks", "diagnosis", "archive"}
MAX_LINES = 200


def test_every_record_sits_in_a_topic_folder():
    top = sorted(p.name for p in RESULTS.iterdir())
    assert [n for n in top if (RESULTS / n).is_file()] == ["README.md"], top  # the index, no loose record
    assert {n for n in top if (RESULTS / n).is_dir()} == TOPICS
    index = (RESULTS / "README.md").read_text()
    for topic in TOPICS:
        assert f"[`{topic}/`]({topic}/)" in index, topic


def test_no_two_records_share_a_name():
    seen = {}
    for p in sorted(RESULTS.glob("*/*")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a name: load_result could not tell them apart"
        seen[p.name] = p
        assert bench.result_path(p.name, results_dir=RESULTS) == p


def test_a_record_is_found_by_name_in_its_topic_folder_and_two_of_a_name_are_an_error(tmp_path):
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "unit.json").write_text('{"value": 1}')
    assert bench.load_result("unit", results_dir=tmp_path) == {"value": 1}
    assert bench.Records(tmp_path) / "unit.json" == tmp_path / "ladder" / "unit.json"
    assert bench.result_path("absent.json", topic="ladder", results_dir=tmp_path) == tmp_path / "ladder" / "absent.json"
    (tmp_path / "unit.json").write_text('{"value": 2}')  # an installed release keeps its records at the top
    with pytest.raises(LabkitError, match="two recorded results"):
        bench.load_result("unit", results_dir=tmp_path)


def test_recorded_results_load_by_name_from_their_topic_folders():
    assert bench.load_result("ladder")["rungs"]
    assert bench.result_path("trace_corpus") == RESULTS / "diagnosis" / "trace_corpus"


def test_topic_pages_are_short_and_cite_no_archived_record():
    archived = sorted(p.name for p in (RESULTS / "archive").iterdir())
    pages = [ROOT / "docs" / "results.md", *sorted(p for p in PAGES.glob("*.md") if p.name != "log.md")]
    assert len(pages) > 5
    for page in pages:
        text = page.read_text()
        assert len(text.splitlines()) <= MAX_LINES, f"{page.name}: {len(text.splitlines())} lines"
        for name in archived:
            assert not re.search(rf"(?<![\w/]){re.escape(name)}", text), f"{page.name} cites archived {name}"
        assert "results/archive/" not in text.replace("`benchmarks/results/archive/`", ""), page.name


def test_the_index_links_every_topic_page_and_the_readme_links_the_index():
    index = (ROOT / "docs" / "results.md").read_text()
    for page in sorted(PAGES.glob("*.md")):
        assert f"](results/{page.name})" in index, page.name
    assert "](docs/results.md)" in (ROOT / "README.md").read_text()
