"""The benchmark tables are rendered from the results records: README.md's headline table and the docs pages
say what ``benchmarks/render.py`` renders, and every record holds the fields the schema requires.

Runs no benchmark: it reads ``benchmarks/results/`` and renders in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.examples_loader import load_benchmark

records = load_benchmark("records")
render = load_benchmark("render")
RECORDS = records.record_paths()


def test_readme_table_and_docs_pages_are_what_the_records_render() -> None:
    stale = render.check()
    assert not stale, f"differ from the results records (run python benchmarks/render.py): {stale}"


def test_every_benchmark_has_a_page_and_a_record() -> None:
    for name in render.BENCHMARKS:
        assert (render.DOCS / f"{name}.md").exists(), name
    assert {p.parent.name for p in RECORDS} <= set(render.BENCHMARKS)


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_record_is_valid(path: Path) -> None:
    record = json.loads(path.read_text())
    assert records.validate(record) == []
    assert record["benchmark"] == path.parent.name


def test_validate_names_what_is_missing() -> None:
    record = json.loads(RECORDS[0].read_text())
    del record["machine"]
    assert records.validate(record) == ["no 'machine'"]
    record = json.loads(RECORDS[0].read_text())
    record["headline"] = ["no-such-figure"]
    assert any("no-such-figure" in p for p in records.validate(record))


def test_a_written_record_validates_and_renders(tmp_path: Path) -> None:
    run = records.start("bench_store", ["--repeat", "3"])
    fig = records.figure("x", "CPU tier load", "GB/s", 2.5, records.ref("np.copyto", 3.1, 0.81), group="g")
    path = records.write(run, [fig], headline=["x"], machine={"filesystem": "ext4"}, results=tmp_path)
    record = json.loads(path.read_text())
    assert records.validate(record) == []
    assert record["command"] == "python benchmarks/bench_store.py --repeat 3"
    assert record["machine"]["extra"] == {"filesystem": "ext4"} and record["machine"]["cores"]
    table = render.readme_table({"bench_store": [record]})
    assert "| CPU tier load | 2.50 GB/s | 3.10 GB/s (np.copyto) | 0.81 |" in table
