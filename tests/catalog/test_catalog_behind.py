"""Write-behind catalog rows: a store queues its row (and journals it); flushes write it; a killed process's
rows are replayed by the next catalog opened on the directory.

Real SQLite files and real processes (``tests/workers.py persist-store PATH abort`` stores every kind of
value, one key twice, and dies with ``os._exit`` before any flush).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.catalog.catalog import StoreRow
from tests.workers import persistence_values

WORKERS = str(Path(__file__).parents[1] / "workers.py")
TIMER = 1.0  # kvmem.core._CATALOG_FLUSH_SECONDS: a row is written at most this long after its store


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[kvmem.Memory]:
    m = kvmem.Memory(str(tmp_path / "kvmem"), cpu_bytes="8MiB", disk_bytes="64MiB", fsync="never")
    yield m
    m.close()


def journal_rows(path: Path) -> list[dict[str, object]]:
    rows = []
    for f in sorted((path / "catalog-pending").glob("pending.*")):
        rows += [json.loads(line.partition("\t")[0]) for line in f.read_text().splitlines()]  # JSON \t CRC32
    return rows


def db_rows(path: Path) -> dict[str, tuple[int, dict[str, object]]]:
    """``key -> (version, metadata)`` read from the SQLite file itself (no kvmem, no replay)."""
    conn = sqlite3.connect(path / "catalog.sqlite3")
    try:
        return {k: (v, json.loads(m)) for k, v, m in conn.execute("SELECT key, version, metadata FROM kvmem_entries")}
    finally:
        conn.close()


def test_a_row_is_written_behind_and_info_flushes_it_first(mem: kvmem.Memory, tmp_path: Path) -> None:
    started = time.monotonic()
    skey = mem.store("a", torch.arange(10), metadata={"n": 1})
    if time.monotonic() - started < TIMER / 2:  # NOTE: the timer cannot have written it yet
        assert mem._catalog.get(skey) is None, "the row was written before the store returned"
        assert [r["key"] for r in journal_rows(tmp_path / "kvmem")] == [skey]
    info = mem.info("a")
    assert info is not None and info.version == 1 and info.metadata == {"n": 1} and info.kind == "tensor"
    row = mem._catalog.get(skey)
    assert row is not None and row.version == 1
    assert journal_rows(tmp_path / "kvmem") == [], "rows the database has stay journaled"


def test_two_stores_before_a_flush_make_one_row_of_version_two(mem: kvmem.Memory) -> None:
    mem.store("k", torch.zeros(3), metadata={"which": "first"})
    mem.store("k", torch.ones(3), metadata={"which": "second"})
    mem.flush()
    row = mem._catalog.get(mem.storage_key("k"))
    assert row is not None and row.version == 2 and row.metadata == {"which": "second"}
    assert row.created <= row.last_access
    mem.store("k", torch.ones(3) * 2, metadata={"which": "third"})
    info = mem.info("k")
    assert info is not None and info.version == 3 and info.metadata == {"which": "third"}


def test_stats_entries_and_store_many_see_queued_rows(mem: kvmem.Memory) -> None:
    skeys = mem.store_many({f"m{i}": torch.full((4,), float(i)) for i in range(5)})
    mem.store("single", b"bytes", metadata={"x": [1, 2]})
    assert mem.stats().entries == 6
    assert {e.key for e in mem.entries()} == set(skeys) | {mem.storage_key("single")}
    for k in skeys:
        row = mem._catalog.get(k)
        assert row is not None and row.version == 1 and row.kind == "tensor" and row.metadata == {}


@pytest.mark.parametrize("stack", [{"cpu_bytes": "8MiB", "disk_bytes": 0}, {"cpu_bytes": "8MiB", "disk_bytes": "8MiB"}])
def test_the_row_records_the_blob_crc_computed_at_the_flush(tmp_path: Path, stack: dict[str, object]) -> None:
    with kvmem.Memory(str(tmp_path / "kvmem"), fsync="never", **stack) as m:  # type: ignore[arg-type]
        skey = m.store("c", torch.randn(2, 4, 32, 64)[:, :, 8:24])
        m.flush()
        row = m._catalog.get(skey)
        buf = m._tiers.tiers[0].get(skey)
        assert row is not None and buf is not None
        blobfmt.verify(buf.clone())
        assert row.crc == blobfmt.stored_crc(buf) != 0


def test_the_timer_writes_the_row_without_a_flush_call(mem: kvmem.Memory) -> None:
    skey = mem.store("timed", "value")
    deadline = time.monotonic() + 10 * TIMER
    while mem._catalog.get(skey) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    row = mem._catalog.get(skey)
    assert row is not None and row.version == 1 and row.kind == "str"


def test_rows_of_a_process_killed_before_its_flush_are_replayed(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    done = subprocess.run(
        [sys.executable, WORKERS, "persist-store", str(path), "abort"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "stored", done.stderr
    expected = persistence_values()
    with kvmem.Memory(str(tmp_path / "keys-only"), cpu_bytes="1MiB", disk_bytes=0) as namer:
        skeys = {namer.storage_key(k): k for k in expected}
    journaled = journal_rows(path)
    assert len(journaled) == len(expected) + 1  # "versioned" was stored twice
    # the store that returned last never reached the database: only the journal has it
    last = journaled[-1]["key"]
    assert last in skeys and last not in db_rows(path)

    for reopen in range(2):  # a second reopen replays nothing again
        with kvmem.Memory(str(path), cpu_bytes="8MiB", disk_bytes="64MiB") as mem:
            for key, (_value, meta) in expected.items():
                info = mem.info(key)
                assert info is not None, f"reopen {reopen}: {key} has no row"
                assert info.version == (2 if key == "versioned" else 1), (reopen, key, info.version)
                assert info.metadata == (meta or {}), (reopen, key)  # the newest store's metadata
            assert mem.stats().entries == len(expected)
        assert list((path / "catalog-pending").glob("pending.*")) == [], "a replayed journal was left behind"
    assert {skeys[k]: v for k, (v, _m) in db_rows(path).items()} == {k: 2 if k == "versioned" else 1 for k in expected}


def test_a_key_deleted_before_its_row_was_written_stays_deleted(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    with kvmem.Memory(str(path), cpu_bytes="8MiB", disk_bytes="64MiB", fsync="never") as m:
        m.store("kept", "kept value")
        m.flush()
        m.store("deleted", "deleted value")  # queued, journaled ...
        assert m.delete("deleted")  # ... and deleted before any flush wrote it
        assert m.info("deleted") is None
    assert journal_rows(path) == [], "the journal still holds the store of a deleted key"
    with kvmem.Memory(str(path), cpu_bytes="8MiB", disk_bytes="64MiB") as m:
        assert m.info("deleted") is None, "the deleted key's row came back from the journal"
        assert m.load("deleted") is None
        assert m.stats().entries == 1
        assert m.verify(progress=False).ok


def test_a_key_deleted_by_a_killed_process_is_not_replayed(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    done = subprocess.run(
        [sys.executable, WORKERS, "store-delete-abort", str(path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "stored", done.stderr
    with kvmem.Memory(str(path), cpu_bytes="8MiB", disk_bytes="64MiB") as m:
        kept = m.info("kept")
        assert kept is not None and kept.metadata == {"kept": True} and kept.version == 1
        assert m.info("deleted") is None, "the deleted key's row came back from the killed process's journal"
        assert m.stats().entries == 1
        assert m.verify(progress=False).ok


def test_two_flushes_of_a_key_commit_in_the_order_their_stores_were_made(tmp_path: Path) -> None:
    """A flush that started first commits first: else the row ends with the total version but the CRC of
    an older store (what a pin racing the flush timer once saw on PostgreSQL)."""
    from sqlalchemy import event

    from kvmem.catalog.catalog import Catalog

    catalog = Catalog(f"sqlite:///{tmp_path / 'c.sqlite3'}", flush_seconds=None)
    first_writing = threading.Event()

    @event.listens_for(catalog.engine, "before_cursor_execute")
    def hold_the_first_write(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("INSERT") and not first_writing.is_set():
            first_writing.set()
            time.sleep(0.5)  # NOTE: the second store's flush runs meanwhile

    def store(crc: int) -> None:
        catalog.upsert_later(
            StoreRow(
                "k" * 64,
                namespace="",
                user_key="k",
                kind="bytes",
                size=1,
                stored_size=1,
                codec="none",
                crc=crc,
                tiers=["disk"],
                metadata={},
            )
        )

    store(1)
    first = threading.Thread(target=catalog.flush)
    first.start()
    assert first_writing.wait(10)
    store(2)
    catalog.flush()
    first.join()
    row = catalog.get("k" * 64)
    assert row is not None and (row.version, row.crc) == (2, 2)
    catalog.close()


def test_a_row_whose_bytes_live_in_ram_only_is_not_journaled(tmp_path: Path) -> None:
    # nothing would be left for it to name after a crash; a store that reached the disk tier is journaled
    ram = kvmem.Memory(str(tmp_path / "ram"), cpu_bytes="8MiB", disk_bytes=0)
    both = kvmem.Memory(str(tmp_path / "both"), cpu_bytes="8MiB", disk_bytes="64MiB", fsync="never")
    try:
        ram.store("a", torch.arange(10))
        skey = both.store("a", torch.arange(10))
        assert journal_rows(tmp_path / "ram") == []
        journaled = [r["key"] for r in journal_rows(tmp_path / "both")]
        assert journaled in ([skey], []), journaled  # [] only if the timer flushed it already
        ram.flush()
        assert ram.info("a") is not None, "the row is still written to the catalog"
    finally:
        ram.close()
        both.close()
