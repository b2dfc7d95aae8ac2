"""Tier faults: a failing tier is skipped, counted and retried; write-back; a failing catalog.

A full disk cannot be made for real here, so ``ENOSPC`` / ``EIO`` are injected by
wrapping one method of a real :class:`DiskTier` (everything else stays real);
write-back ordering is observed by holding a real disk write at a gate.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.exc import OperationalError

import kvmem
from kvmem import blob as blobfmt
from kvmem.stores import DiskTier, StorageTier

RETRY = 0.2
SETTINGS: dict[str, Any] = {"cpu_bytes": "1MiB", "disk_bytes": "8MiB", "fsync": "never", "tier_retry_seconds": RETRY}


class Fault:
    """Makes methods of one real tier raise ``OSError(code)`` while ``on``; counts the calls."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, tier: StorageTier, names: tuple[str, ...], code: int = errno.ENOSPC
    ) -> None:
        self.on = True
        self.calls = 0
        for name in names:
            monkeypatch.setattr(tier, name, self._wrap(getattr(tier, name), code))

    def _wrap(self, real: Callable[..., Any], code: int) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.on:
                raise OSError(code, os.strerror(code))
            return real(*args, **kwargs)

        return method


class Gate:
    """Holds every ``put`` of one real tier until ``release()``; records the keys that reached it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tier: StorageTier) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()
        self.keys: list[str] = []
        real = tier.put

        def put(key: str, blob: blobfmt.EncodedBlob) -> None:
            self.keys.append(key)
            self.entered.set()
            self._open.wait(timeout=30)
            real(key, blob)

        monkeypatch.setattr(tier, "put", put)

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[kvmem.Memory]:
    m = kvmem.Memory(tmp_path / "kvmem", **SETTINGS)
    yield m
    m.close()


def _disk(m: kvmem.Memory) -> DiskTier:
    tier = m._tiers.tiers[-1]
    assert isinstance(tier, DiskTier)
    return tier


def _on_disk(m: kvmem.Memory, key: str) -> bool:
    return _disk(m).path(m.storage_key(key)).exists()


def _errors(m: kvmem.Memory, tier: str) -> int:
    return int(m.metrics.value("kvmem_tier_errors_total", tier=tier))


def _value(i: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32) + i


# -- a failing tier -----------------------------------------------------------------------------------


def test_failing_disk_writes_are_skipped_counted_and_retried(
    mem: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _disk(mem)
    fault = Fault(monkeypatch, disk, ("put",))

    mem.store("a", _value(0))  # no OSError reaches the caller
    mem.store("b", _value(1))  # within tier_retry_seconds: the disk is not even tried
    assert fault.calls == 1 and _errors(mem, "disk") == 1
    assert not mem._tiers.healthy(disk)
    assert [t.healthy for t in mem.stats().tiers] == [True, False]
    assert torch.equal(mem.load("a"), _value(0))  # served from the CPU tier
    assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1
    info = mem.info("a")
    assert info is not None and info.tiers == ["cpu"]

    time.sleep(RETRY * 1.5)
    mem.store("c", _value(2))  # retried, still failing
    assert fault.calls == 2 and _errors(mem, "disk") == 2

    fault.on = False
    time.sleep(RETRY * 1.5)
    mem.store("d", _value(3))  # retried, healthy again
    assert fault.calls == 3 and _errors(mem, "disk") == 2
    assert mem._tiers.healthy(disk) and _on_disk(mem, "d")
    assert not _on_disk(mem, "a") and not _on_disk(mem, "b")
    assert mem.stats().tier_errors == 2
    for i, key in enumerate("abcd"):
        assert torch.equal(mem.load(key), _value(i))


def test_enospc_in_the_middle_of_a_write_leaves_no_partial_file(
    mem: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvmem.stores.files as files_module

    real_pwrite_all = files_module.pwrite_all

    def write_half_then_fail(fd: int, parts: list[Any], offset: int) -> int:
        real_pwrite_all(fd, parts[: len(parts) // 2], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    mem.store("before", _value(0))
    monkeypatch.setattr(files_module, "pwrite_all", write_half_then_fail)
    mem.store("during", _value(1))
    monkeypatch.setattr(files_module, "pwrite_all", real_pwrite_all)

    blobs = _disk(mem).root / "blobs"
    assert sorted(p.name for p in blobs.rglob("*") if p.is_file()) == [f"{mem.storage_key('before')}.kvb"]
    assert _errors(mem, "disk") == 1
    assert torch.equal(mem.load("during"), _value(1))  # the CPU copy
    assert _disk(mem).usage() == _disk(mem).path(mem.storage_key("before")).stat().st_size


def test_failing_disk_reads_are_a_miss_and_the_cpu_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        m.store("on-disk", _value(0))
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:  # CPU tier empty: "on-disk" is on disk only
        fault = Fault(monkeypatch, _disk(m), ("get", "read_verified"), errno.EIO)
        assert m.load("on-disk", default="miss") == "miss"
        m.store("in-cpu", _value(1))  # the disk is skipped while down; the CPU takes it
        assert _errors(m, "disk") == 1 and not m._tiers.healthy(_disk(m))
        assert torch.equal(m.load("in-cpu"), _value(1))
        assert not _on_disk(m, "in-cpu")
        assert m.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1

        fault.on = False
        time.sleep(RETRY * 1.5)
        assert torch.equal(m.load("on-disk"), _value(0))
        assert m.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 1
        assert _errors(m, "disk") == 1


def test_every_tier_failing_is_a_kvmem_error_not_an_oserror(mem: kvmem.Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    mem.store("kept", _value(0))
    Fault(monkeypatch, mem._tiers.tiers[0], ("put",))
    Fault(monkeypatch, _disk(mem), ("put",))
    with pytest.raises(kvmem.TierUnavailable, match="no tier could store") as err:
        mem.store("new", _value(1))
    assert not isinstance(err.value, OSError)
    assert _errors(mem, "cpu") == 1 and _errors(mem, "disk") == 1
    time.sleep(RETRY * 1.5)  # both tiers are skipped until then, for loads too
    assert torch.equal(mem.load("kept"), _value(0))
    assert mem.load("new", default="miss") == "miss" and mem.info("new") is None


def test_failing_delete_and_contains_do_not_raise(mem: kvmem.Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    mem.store("a", _value(0))
    Fault(monkeypatch, _disk(mem), ("delete", "contains"), errno.EIO)
    assert mem.delete("a") is True  # gone from the CPU tier; the disk copy could not be removed
    assert _errors(mem, "disk") == 1
    assert mem.contains("a") is False  # the disk is down: skipped


# -- write-around -------------------------------------------------------------------------------------


def test_write_around_stores_to_disk_and_the_cpu_tier_holds_only_what_is_warmed(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", write_policy="around", **SETTINGS) as m:
        m.store_many([("a", _value(0)), ("b", _value(1))])
        skey = m.storage_key("a")
        assert m._tiers.holders(skey) == ["disk"] and m._tiers.holders(m.storage_key("b")) == ["disk"]
        out = torch.empty(256, dtype=torch.int32)
        for _ in range(2):  # a hit is not promoted into the CPU tier: the second load reads the disk again
            assert torch.equal(m.load("a"), _value(0)) and m.load("a", out=out) is out
        assert torch.equal(out, _value(0)) and m._tiers.holders(skey) == ["disk"]
        assert m.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 4
        assert m.chunk_store().warm(skey) is True  # warmed on purpose: the CPU tier takes it
        assert m._tiers.holders(skey) == ["cpu", "disk"]
        assert torch.equal(m.load("a"), _value(0))
        assert m.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1
        assert m.chunk_store().warm(m.storage_key("missing")) is False


def test_write_around_with_the_disk_down_stores_in_the_cpu_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with kvmem.Memory(tmp_path / "kvmem", write_policy="around", **SETTINGS) as m:
        Fault(monkeypatch, _disk(m), ("put", "put_many"))
        m.store("kept", _value(2))  # not lost: the CPU tier takes it while the disk is skipped
        assert _errors(m, "disk") == 1 and not _on_disk(m, "kept")
        assert torch.equal(m.load("kept"), _value(2))


def test_write_around_needs_a_persistent_tier(tmp_path: Path) -> None:
    with pytest.raises(kvmem.ConfigError, match=r"write_policy='around': accepted through \| back without"):
        kvmem.Memory(tmp_path / "kvmem", write_policy="around", disk_bytes=0)


# -- write-back ---------------------------------------------------------------------------------------


@pytest.fixture
def back(tmp_path: Path) -> Iterator[kvmem.Memory]:
    m = kvmem.Memory(tmp_path / "kvmem", write_policy="back", write_back_queue=2, **SETTINGS)
    yield m
    m.close()


def test_write_back_returns_before_the_disk_write_and_reaches_disk_on_flush(
    back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = Gate(monkeypatch, _disk(back))
    try:
        back.store("a", _value(0))  # returns although the disk write is held
        assert gate.entered.wait(5) and not _on_disk(back, "a")
        assert torch.equal(back.load("a"), _value(0))
    finally:
        gate.release()
    back.flush()
    assert _on_disk(back, "a") and gate.keys == [back.storage_key("a")]
    raw = _disk(back).path(back.storage_key("a")).read_bytes()
    blobfmt.verify(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    back.close()
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        assert torch.equal(m.load("a"), _value(0))
        assert m.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 1


def test_a_value_the_top_tier_refused_is_written_back_as_it_was_when_stored(
    back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU tier refuses the value (its pages are all lent out), so only the write-back stores it: from a
    copy made before ``store`` returned, not from the caller's tensor, which changes meanwhile."""
    lent = back.lease_host(1 << 20)
    assert lent is not None  # every page of the 1 MiB CPU tier: it refuses any value now
    gate = Gate(monkeypatch, _disk(back))
    value = _value(0)
    try:
        back.store("a", value)  # queued for the disk, not refused: no error
        assert gate.entered.wait(5)
        value += 1000  # the caller reuses its tensor (a KV view the engine writes next)
    finally:
        gate.release()
    back.flush()
    assert torch.equal(back.load("a"), _value(0))


def test_delete_of_a_queued_write_back_does_not_resurrect_the_key(
    back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = Gate(monkeypatch, _disk(back))
    try:
        back.store("first", _value(0))
        assert gate.entered.wait(5)  # the writer holds "first"; "queued" waits behind it
        back.store("queued", _value(1))
        assert back.delete("queued") is True
    finally:
        gate.release()
    back.flush()
    assert gate.keys == [back.storage_key("first")]
    assert _on_disk(back, "first") and not _on_disk(back, "queued")
    assert back.load("queued", default="miss") == "miss"
    back.close()
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        assert m.load("queued", default="miss") == "miss"


def test_delete_while_its_write_back_is_in_flight_does_not_resurrect_the_key(
    back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = Gate(monkeypatch, _disk(back))
    deleted: list[bool] = []
    try:
        back.store("a", _value(0))
        assert gate.entered.wait(5)  # the writer is inside the disk put of "a"
        deleter = threading.Thread(target=lambda: deleted.append(back.delete("a")))
        deleter.start()
        time.sleep(0.2)
    finally:
        gate.release()
    deleter.join(5)
    assert deleted == [True]
    back.flush()
    assert not _on_disk(back, "a")
    assert back.load("a", default="miss") == "miss"
    back.close()
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        assert m.load("a", default="miss") == "miss"


def test_bounded_write_back_queue_applies_backpressure(back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, _disk(back))
    stored: list[int] = []

    def producer() -> None:
        for i in range(5):
            back.store(f"k{i}", _value(i))
            stored.append(i)

    thread = threading.Thread(target=producer)
    try:
        thread.start()
        assert gate.entered.wait(5)
        deadline = time.monotonic() + 5
        while len(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        # queue of 2: "k0" (being written) and "k1" are pending, so storing "k2" waits
        assert stored == [0, 1] and thread.is_alive()
    finally:
        gate.release()
    thread.join(10)
    assert stored == [0, 1, 2, 3, 4]
    back.flush()
    assert all(_on_disk(back, f"k{i}") for i in range(5))


def test_write_back_to_a_failing_disk_is_counted_not_raised(
    back: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = Fault(monkeypatch, _disk(back), ("put",))
    back.store("a", _value(0))
    back.flush()  # the background write failed; nobody sees an OSError
    assert fault.calls == 1 and _errors(back, "disk") == 1
    assert torch.equal(back.load("a"), _value(0))
    assert not _on_disk(back, "a")


# -- a failing catalog --------------------------------------------------------------------------------


def test_catalog_that_cannot_be_opened_any_more(tmp_path: Path) -> None:
    """The catalog's directory replaced by a file: every new database connection fails for real."""
    catalog_dir = tmp_path / "catalog"
    m = kvmem.Memory(tmp_path / "kvmem", catalog_url=f"sqlite:///{catalog_dir / 'catalog.sqlite3'}", **SETTINGS)
    m.store("before", _value(0))
    m._catalog.engine.dispose()
    shutil.rmtree(catalog_dir)  # the database and its records (catalog.sqlite3.records/)
    catalog_dir.write_text("not a directory")

    m.store("during", _value(1), metadata={"x": 1})
    assert torch.equal(m.load("during"), _value(1)) and torch.equal(m.load("before"), _value(0))
    assert m.load("missing", regenerate=lambda: _value(2)) is not None
    assert m.delete("before") is True
    assert m.load("before", default="miss") == "miss"
    m.flush()  # NOTE: stores queue their rows (write-behind): the flush and the delete meet the broken database
    assert _errors(m, "catalog") >= 2
    assert m.stats().entries == 0  # unknown, not an exception
    m.close()


def test_catalog_operational_errors_do_not_reach_store_or_load(
    mem: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    mem.store("before", _value(0))

    def broken(*args: object, **kwargs: object) -> None:
        raise OperationalError("INSERT INTO kvmem_entries", {}, Exception("disk I/O error"))

    monkeypatch.setattr(mem._catalog.engine, "begin", broken)
    monkeypatch.setattr(mem._catalog.engine, "connect", broken)
    mem.store("during", _value(1))
    mem.store("during", _value(2))
    assert torch.equal(mem.load("during"), _value(2))
    assert torch.equal(mem.load("before"), _value(0))
    assert mem.delete("before") and mem.load("before", default="miss") == "miss"
    assert mem.info("during") is None and list(mem.entries()) == []  # what the catalog cannot say, unsaid
    assert _errors(mem, "catalog") >= 5
    mem.flush()

    monkeypatch.undo()  # the database is back: the data path never lost anything
    mem.store("after", _value(3))
    info = mem.info("after")
    assert info is not None and info.version == 1
    mem.flush()  # the writes missed during the outage are replayed (the timer would do it within a second)
    during = mem.info("during")
    assert during is not None and during.version == 2 and mem.info("before") is None
    assert mem.verify(progress=False).orphans == []
