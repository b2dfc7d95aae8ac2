"""Online blob-format migration of the disk tier: ``kvmem migrate --to-format N`` while entries are served.

Real files, a real SQLite catalog, the migration in another real process (the CLI)
while this one reads, writes and deletes; a migration killed half-way and resumed.
"""

from __future__ import annotations

import json
import os
import signal
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
from kvmem.cli.doctor import check
from kvmem.cli.doctor_snapshot import take_snapshot
from kvmem.codecs import parse_codec
from kvmem.codecs.serialization import encode_value
from kvmem.errors import ConfigError
from kvmem.ops.migrate import _hottest_first
from kvmem.stores import DiskTier
from kvmem.stores.areas import AreaState, DiskAreas, read_state, write_state
from tests.workers import check_value, make_value

SETTINGS: dict[str, object] = {"cpu_bytes": "4KiB", "disk_bytes": "1GiB", "fsync": "never"}  # loads read the disk


def legacy_memory(path: Path, **settings: object) -> kvmem.Memory:
    """A Memory on a data directory whose disk tier is still in blob format 1."""
    write_state(path / "disk", AreaState("blobs", 1))
    return kvmem.Memory(path, **{**SETTINGS, **settings})


def disk_of(mem: kvmem.Memory) -> DiskTier:
    return next(t for t in mem._tiers.tiers if isinstance(t, DiskTier))


def formats(root: Path, area: str) -> set[tuple[int, int]]:
    """``(format, alignment)`` of every blob file in ``area``."""
    return {
        blobfmt.format_of(torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8))
        for f in (root / area).rglob("*.kvb")
    }


def run_cli(path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmem", "migrate", "--path", str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def legacy(tmp_path: Path) -> Iterator[kvmem.Memory]:
    mem = legacy_memory(tmp_path / "data")
    yield mem
    mem.close()


def test_every_entry_is_rewritten_hottest_first_then_the_areas_switch(legacy: kvmem.Memory) -> None:
    big = {f"big{i}": torch.randn(600_000, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    for name, value in big.items():
        legacy.store(name, value, compression="int8+lz4")  # quantized bytes must come through untouched
    for i in range(40):
        legacy.store(f"k{i}", make_value(f"k{i}", 1))
    before = {name: legacy.load(name) for name in big}
    for i in (7, 3, 21):
        for _ in range(10 - i % 5):
            legacy.load(f"k{i}")
    legacy.flush()
    root = disk_of(legacy).root
    assert formats(root, "blobs") == {(1, 64)}
    order = _hottest_first(DiskAreas(disk_of(legacy)), legacy._catalog, "blobs")
    skeys = {legacy.storage_key(f"k{i}"): i for i in range(40)}
    hits = [legacy._catalog.get(k).hits for k in order]  # type: ignore[union-attr]
    assert hits == sorted(hits, reverse=True) and [skeys.get(k) for k in order[:3]] == [21, 7, 3]

    report = legacy.migrate(2, progress=False)

    assert (report.to_format, report.area, report.migrated, report.resumed) == (2, "blobs.f2", 43, False)
    assert read_state(root) == AreaState("blobs.f2", 2) and not (root / "blobs").exists()
    assert formats(root, "blobs.f2") == {(2, 64), (2, blobfmt.PAGE)}  # large blobs are page-aligned now
    for i in range(40):
        assert check_value(f"k{i}", legacy.load(f"k{i}")) == 1
    for name, value in before.items():
        assert torch.equal(legacy.load(name), value)  # bit-exact: the int8 parts were not requantized
    pin = legacy.pin("k3")  # the catalog names the rewritten blobs: pins find their version
    assert pin is not None and check_value("k3", pin.load()) == 1
    legacy.store("new", make_value("new", 1))
    assert formats(root, "blobs.f2") == {(2, 64), (2, blobfmt.PAGE)}
    assert legacy.migrate(2).migrated == 0  # already there: nothing to do
    with kvmem.Memory(legacy.config.path, **SETTINGS) as reopened:
        assert all(check_value(f"k{i}", reopened.load(f"k{i}")) == 1 for i in range(40))


def test_reads_writes_and_deletes_of_another_process_go_on_during_the_migration(legacy: kvmem.Memory) -> None:
    n = 600
    for i in range(n):
        legacy.store(f"k{i}", make_value(f"k{i}", 1))
    legacy.flush()
    expected: dict[str, int | None] = {f"k{i}": 1 for i in range(n)}
    churned = {f"k{i}" for i in range(0, n, 5)}  # rewritten or deleted while the migration runs
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                for i in range(1, n, 5):  # keys nobody touches: never a miss, always version 1
                    assert check_value(f"k{i}", legacy.load(f"k{i}")) == 1
        except BaseException as exc:
            errors.append(exc)

    def churn() -> None:
        try:
            for j, key in enumerate(sorted(churned)):
                if done.is_set():
                    return
                if j % 3 == 0:
                    legacy.delete(key)
                    expected[key] = None
                else:
                    legacy.store(key, make_value(key, 2))
                    expected[key] = 2
                legacy.store(f"new{j}", make_value(f"new{j}", 1))
                expected[f"new{j}"] = 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read), threading.Thread(target=churn)]
    for t in threads:
        t.start()
    proc = run_cli(Path(legacy.config.path), "--to-format", "2", "--json")
    out, err = proc.communicate(timeout=240)
    done.set()
    for t in threads:
        t.join(timeout=60)
    assert proc.returncode == 0, err
    assert errors == [], errors
    report = json.loads(out)
    assert report["to_format"] == 2 and report["area"] == "blobs.f2"
    root = disk_of(legacy).root
    assert not (root / "blobs").exists() and formats(root, "blobs.f2") == {(2, 64)}
    for key, version in expected.items():
        value = legacy.load(key)
        assert (value is None) if version is None else check_value(key, value) == version, key
    assert legacy.stats().tier_errors == 0


def test_a_killed_migration_resumes_and_meanwhile_nothing_is_missed(legacy: kvmem.Memory) -> None:
    n = 1500
    for i in range(n):
        legacy.store(f"k{i}", {"i": i, "pad": "x" * 5000})
    hot = [f"k{i}" for i in range(n - 1, n - 300, -23)]  # the hottest, stored late
    for rank, key in enumerate(hot):
        for _ in range(len(hot) - rank):
            legacy.load(key)
    legacy.flush()
    root = disk_of(legacy).root
    proc = run_cli(Path(legacy.config.path), "--to-format", "2")
    deadline = time.monotonic() + 120
    while sum(1 for _ in (root / "blobs.f2").rglob("*.kvb")) < 2 * len(hot) and time.monotonic() < deadline:
        assert proc.poll() is None, "the migration finished before it could be interrupted"
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    state = read_state(root)
    assert state.target == "blobs.f2" and state.active == "blobs"  # recorded before the first copy
    carried = {f.name.removesuffix(".kvb") for f in (root / "blobs.f2").rglob("*.kvb")}
    assert {legacy.storage_key(k) for k in hot} <= carried  # hottest first
    assert 0 < len(carried) < n
    assert all(legacy.load(f"k{i}") == {"i": i, "pad": "x" * 5000} for i in range(n))  # from either area
    legacy.store("during", {"i": -1})
    assert formats(root, "blobs.f2") == {(2, 64)}  # writes go to the new area, in its format
    unfinished = [f for f in check(take_snapshot(legacy, live=False)) if "migration" in f.title]
    assert [f.severity for f in unfinished] == ["warn"]  # kvmem doctor says how to finish it

    with pytest.raises(ConfigError, match="a migration to format 2 is under way"):
        legacy.migrate(1)
    report = legacy.migrate(2, progress=False)
    assert report.resumed and report.migrated + report.present == n and report.present >= len(carried)
    assert read_state(root) == AreaState("blobs.f2", 2) and not (root / "blobs").exists()
    assert all(legacy.load(f"k{i}") == {"i": i, "pad": "x" * 5000} for i in range(n))
    assert legacy.load("during") == {"i": -1}


def test_a_writer_that_missed_the_switch_moves_its_file_into_the_new_area(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    write_state(root, AreaState("blobs", 1))
    stale, migrator = DiskTier(root, 1 << 30, fsync="never"), DiskTier(root, 1 << 30, fsync="never")
    key = "ab" * 32
    blob_v1, _ = encode_value({"x": 1}, parse_codec("none"), info={"storage_key": key}, blob_format=1)
    assert stale.blob_format == 1
    DiskAreas(migrator).set_state(read_state(root).migrating_to(2))  # the stale tier has not looked since
    stale.put(key, blob_v1)
    assert not (root / "blobs" / key[:2] / f"{key}.kvb").exists()
    assert formats(root, "blobs.f2") == {(2, 64)} and stale.blob_format == 2
    assert stale.read_verified(key) is not None and migrator.read_verified(key) is not None


def test_refusals_and_legacy_detection(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "fresh", **SETTINGS) as fresh:
        assert read_state(disk_of(fresh).root) == AreaState("blobs", blobfmt.FORMAT_VERSION)
        for bad in (0, 3):
            with pytest.raises(ConfigError, match=f"to_format={bad}"):
                fresh.migrate(bad)
        assert fresh.migrate(2).migrated == 0
    with kvmem.Memory(tmp_path / "nodisk", cpu_bytes="1MiB", disk_bytes=0) as nodisk:
        with pytest.raises(ConfigError, match="no disk tier"):
            nodisk.migrate(2)
    old = tmp_path / "old" / "disk"
    (old / "blobs" / "ab").mkdir(parents=True)
    (old / "blobs" / "ab" / f"{'ab' * 32}.kvb").write_bytes(b"written before formats were recorded")
    assert read_state(old) == AreaState("blobs", 1)
    (old / "areas.json").write_text('{"active": "../../etc", "format": 1, "target": null, "target_format": null}')
    assert read_state(old) == AreaState("blobs", 1)  # an area kvmem never names: damage, set aside and rebuilt
    assert [p.read_text() for p in old.glob("areas.json.corrupt-*")] == [
        '{"active": "../../etc", "format": 1, "target": null, "target_format": null}'
    ]
