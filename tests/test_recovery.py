"""Damaged metadata files: the memory still opens, serves every intact entry and stores again.

Each fault is made for real on a closed data directory (bytes flipped in ``areas.json``,
the SQLite catalog, a dead process's catalog journal); the damaged file must be moved
aside (never deleted), counted in ``kvmem_recovered_files_total`` and shown by the doctor.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import kvmem
from kvmem.cli.doctor import Thresholds, check_integrity
from kvmem.cli.doctor_snapshot import take_snapshot
from kvmem.recovery import MARK, check_sqlite
from kvmem.stores.areas import STATE_FILE

SETTINGS = {"cpu_bytes": "4MiB", "disk_bytes": "64MiB", "fsync": "never"}
N = 6


def _store_all(path: Path) -> None:
    with kvmem.Memory(path, **SETTINGS) as mem:
        for i in range(N):
            mem.store(f"e{i}", {"i": i, "blob": bytes(range(256)) * 4}, metadata={"i": i})


def _check_serves_and_stores(path: Path, file: str) -> None:
    """Open ``path``: every entry loads, its catalog row is there, a new store works, ``file`` was counted once."""
    with kvmem.Memory(path, **SETTINGS) as mem:
        assert [mem.load(f"e{i}")["i"] for i in range(N)] == list(range(N))
        assert [mem.info(f"e{i}").metadata for i in range(N)] == [{"i": i} for i in range(N)]
        mem.store("new", {"i": "new"})
        assert mem.metrics.value("kvmem_recovered_files_total", file=file) == 1
        findings = check_integrity(take_snapshot(mem, live=False), Thresholds())
        assert any("set aside" in f.title and f.severity == "warn" for f in findings)
    with kvmem.Memory(path, **SETTINGS) as mem:  # the rebuilt file is intact: nothing more is set aside
        assert mem.load("new") == {"i": "new"} and mem.stats().entries == N + 1
        assert mem.metrics.total("kvmem_recovered_files_total") == 0


def _flip(file: Path, count: int, seed: int, start: int = 0) -> None:
    """XOR ``count`` bytes of ``file`` (from byte ``start`` on) with 0xFF: never valid UTF-8 text after."""
    data = bytearray(file.read_bytes())
    rng = random.Random(seed)
    for _ in range(count):
        data[rng.randrange(start, len(data))] ^= 0xFF
    file.write_bytes(bytes(data))


def _aside(path: Path, name: str) -> list[Path]:
    return sorted(path.glob(f"{name}{MARK}*"))


@pytest.mark.parametrize("fault", ["flipped", "edited"])
def test_damaged_areas_json_is_set_aside_and_rebuilt_from_the_directories(tmp_path: Path, fault: str) -> None:
    path = tmp_path / "kvmem"
    _store_all(path)
    state = path / "disk" / STATE_FILE
    original = json.loads(state.read_text())
    if fault == "flipped":
        _flip(state, 3, seed=1)
    else:  # NOTE: still valid JSON naming a valid format: only the checksum tells
        state.write_text(json.dumps({**original, "format": 1}))
    damaged = state.read_bytes()
    _check_serves_and_stores(path, "areas")
    assert [p.read_bytes() for p in _aside(path / "disk", STATE_FILE)] == [damaged]
    assert json.loads(state.read_text()) == original


def test_an_intact_areas_json_of_a_newer_format_still_refuses_to_open(tmp_path: Path) -> None:
    from kvmem.stores.areas import _checksum

    path = tmp_path / "kvmem"
    _store_all(path)
    fields = {"active": "blobs", "format": 9, "target": None, "target_format": None}
    (path / "disk" / STATE_FILE).write_text(json.dumps({**fields, "sha256": _checksum(fields)}))
    with pytest.raises(kvmem.ConfigError, match="blob format 9"):
        kvmem.Memory(path, **SETTINGS)
    assert not _aside(path / "disk", STATE_FILE)


@pytest.mark.parametrize("fault", ["header", "pages"])
def test_damaged_sqlite_catalog_is_set_aside_and_its_rows_rebuilt_from_blob_headers(tmp_path: Path, fault: str) -> None:
    path = tmp_path / "kvmem"
    _store_all(path)
    catalog = path / "catalog.sqlite3"
    if fault == "header":
        _flip(catalog, 16, seed=2, start=0)
        catalog.write_bytes(b"\xff" * 16 + catalog.read_bytes()[16:])  # the magic string gone
    else:
        _flip(catalog, 64, seed=3, start=100)
    assert check_sqlite(catalog) is not None
    damaged = catalog.read_bytes()
    _check_serves_and_stores(path, "catalog")
    assert [p.read_bytes() for p in _aside(path, catalog.name)] == [damaged]
    assert check_sqlite(catalog) is None


def test_check_sqlite_gives_no_verdict_on_a_missing_or_empty_file(tmp_path: Path) -> None:
    assert check_sqlite(tmp_path / "none.sqlite3") is None
    (tmp_path / "empty.sqlite3").write_bytes(b"")
    assert check_sqlite(tmp_path / "empty.sqlite3") is None


_KILLED_WRITER = """
import os, sys
import kvmem
mem = kvmem.Memory(sys.argv[1], cpu_bytes="4MiB", disk_bytes="64MiB", fsync="never")
for i in range(int(sys.argv[2])):
    mem.store(f"e{i}", {"i": i, "blob": bytes(range(256)) * 4}, metadata={"i": i})
os._exit(0)  # NOTE: before the catalog's flush: the rows are only in the journal
"""


def test_damaged_journal_lines_are_skipped_the_file_set_aside_and_their_rows_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(path), str(N)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(kvmem.__file__).parents[1])},
    )
    [journal] = (path / "catalog-pending").glob("pending.*")
    lines = journal.read_bytes().split(b"\n")
    assert len(lines) == N + 1 and lines[-1] == b""
    lines[2] = lines[2][:10] + b"\xff" + lines[2][11:]  # not UTF-8
    lines[4] = lines[4].replace(b'"i":4', b'"i":7')  # still JSON: only the CRC tells
    journal.write_bytes(b"\n".join(lines))
    _check_serves_and_stores(path, "journal")
    [aside] = (path / "catalog-pending").glob(f"*{MARK}*")
    assert aside.read_bytes() == b"\n".join(lines)
    with kvmem.Memory(path, **SETTINGS) as mem:
        assert [mem.info(f"e{i}").version for i in range(N)] == [1] * N  # each store recorded once
