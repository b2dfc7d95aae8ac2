"""Corruption: damaged files and an edited catalog never yield a wrong value, and are always counted.

Every fault here is made for real on the files under ``<path>/disk`` and on the
SQLite catalog, with the Memory closed, then the Memory is reopened.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
import torch

import kvmem
from kvmem import blob as blobfmt

MISS = "<miss>"
SETTINGS = {"cpu_bytes": "4MiB", "disk_bytes": "64MiB", "fsync": "never"}
VERIFIED = {**SETTINGS, "cpu_verify": True}  # NOTE: CPU-tier loads re-check CRCs only when asked


def _value(i: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(i)
    return {"k": torch.randn(2, 4, 16, 8, generator=g), "v": torch.randn(2, 4, 16, 8, generator=g), "id": i}


def _same(a: object, b: object) -> bool:
    assert isinstance(a, dict) and isinstance(b, dict)
    return a["id"] == b["id"] and torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


def _store_all(path: Path, n: int, **store_kw: object) -> dict[str, str]:
    """Store ``n`` values (keys ``e0``...), close; return user key -> storage key."""
    with kvmem.Memory(path, **SETTINGS) as mem:
        return {f"e{i}": mem.store(f"e{i}", _value(i), metadata={"i": i}, **store_kw) for i in range(n)}


def _file(path: Path, skey: str) -> Path:
    return path / "disk" / "blobs" / skey[:2] / f"{skey}.kvb"


def _quarantined(path: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in (path / "disk" / "quarantine").glob("*.kvb"))


def _crc_failures(mem: kvmem.Memory) -> int:
    return int(mem.metrics.total("kvmem_crc_failures_total"))


# -- damaged files ------------------------------------------------------------------------------------


def _flip(offset: Callable[[int, int], int]) -> Callable[[Path, random.Random], None]:
    """A fault that XORs one byte, at ``offset(file size, header length)``, with a random non-zero byte."""

    def fault(file: Path, rng: random.Random) -> None:
        data = bytearray(file.read_bytes())
        hlen = int.from_bytes(data[12:16], "little")
        data[offset(len(data), hlen)] ^= rng.randrange(1, 256)
        file.write_bytes(bytes(data))

    return fault


def _truncate(keep: Callable[[int], int]) -> Callable[[Path, random.Random], None]:
    def fault(file: Path, rng: random.Random) -> None:
        data = file.read_bytes()
        file.write_bytes(data[: keep(len(data))])

    return fault


def _zero(file: Path, rng: random.Random) -> None:
    file.write_bytes(bytes(file.stat().st_size))


def _garbage(file: Path, rng: random.Random) -> None:
    file.write_bytes(rng.randbytes(file.stat().st_size))


def _garbage_with_magic(file: Path, rng: random.Random) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:24] + rng.randbytes(len(data) - 24))  # framing intact, header and payload noise


def _append(file: Path, rng: random.Random) -> None:
    with file.open("ab") as f:
        f.write(rng.randbytes(64))


def _crc_rewritten_over_noise(file: Path, rng: random.Random) -> None:
    """A blanked header *with a matching header CRC*: only the framing and decoding can catch it."""
    data = bytearray(file.read_bytes())
    hlen = int.from_bytes(data[12:16], "little")
    data[24 : 24 + hlen] = b" " * hlen
    start = blobfmt.payload_start(hlen)
    crc = crc32c.crc32c(bytes(data[24:start]), crc32c.crc32c(bytes(data[:20])))
    data[20:24] = crc.to_bytes(4, "little")
    file.write_bytes(bytes(data))


FAULTS: dict[str, Callable[[Path, random.Random], None]] = {
    "flip-magic": _flip(lambda n, h: 0),
    "flip-format": _flip(lambda n, h: 8),
    "flip-header-len": _flip(lambda n, h: 13),
    "flip-reserved": _flip(lambda n, h: 17),
    "flip-header-crc": _flip(lambda n, h: 21),
    "flip-header-json": _flip(lambda n, h: 24 + h // 2),
    "flip-header-last": _flip(lambda n, h: 24 + h - 1),
    "flip-padding": _flip(lambda n, h: blobfmt.payload_start(h) - 1),
    "flip-payload-first": _flip(lambda n, h: blobfmt.payload_start(h)),
    "flip-payload-middle": _flip(lambda n, h: (blobfmt.payload_start(h) + n) // 2),
    "flip-payload-last": _flip(lambda n, h: n - 5),
    "flip-last-byte": _flip(lambda n, h: n - 1),
    "truncate-empty": _truncate(lambda n: 0),
    "truncate-3": _truncate(lambda n: 3),
    "truncate-prefix": _truncate(lambda n: 20),
    "truncate-half": _truncate(lambda n: n // 2),
    "truncate-4": _truncate(lambda n: n - 4),
    "truncate-1": _truncate(lambda n: n - 1),
    "append": _append,
    "zero": _zero,
    "garbage": _garbage,
    "garbage-after-magic": _garbage_with_magic,
    "header-blanked-crc-fixed": _crc_rewritten_over_noise,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_damaged_file_is_a_counted_quarantined_miss(tmp_path: Path, fault: str) -> None:
    path = tmp_path / "kvmem"
    keys = _store_all(path, 3)
    FAULTS[fault](_file(path, keys["e1"]), random.Random(fault))

    with kvmem.Memory(path, **SETTINGS) as mem:
        assert mem.load("e1", default=MISS) == MISS
        assert _crc_failures(mem) == 1
        assert mem.metrics.value("kvmem_misses_total", kind="unknown") == 1
        assert not _file(path, keys["e1"]).exists()
        assert _quarantined(path) == [keys["e1"]]
        row = mem._catalog.get(keys["e1"])
        assert row is not None and row.state == "quarantined"
        # the neighbours are untouched, and the damaged key stays a miss (nothing left to read)
        assert _same(mem.load("e0"), _value(0)) and _same(mem.load("e2"), _value(2))
        assert mem.load("e1", default=MISS) == MISS
        assert _crc_failures(mem) == 1


def test_single_byte_flips_at_many_offsets_are_all_caught(tmp_path: Path) -> None:
    """One entry per offset: every region of the blob, each byte flip detected, counted, quarantined."""
    path = tmp_path / "kvmem"
    rng = random.Random(7)
    # the same value under keys of one length: every file has the same size and layout
    with kvmem.Memory(path, **SETTINGS) as mem:
        size = _file(path, mem.store("offprobe", _value(0))).stat().st_size
        mem.delete("offprobe")
    offsets = sorted({*range(0, 80), *rng.sample(range(size), 120), *range(size - 8, size)})
    with kvmem.Memory(path, **SETTINGS) as mem:
        keys = [mem.store(f"off{o:05d}", _value(0)) for o in offsets]
    for o, skey in zip(offsets, keys):
        data = bytearray(_file(path, skey).read_bytes())
        assert len(data) == size
        data[o] ^= rng.randrange(1, 256)
        _file(path, skey).write_bytes(bytes(data))

    with kvmem.Memory(path, **SETTINGS) as mem:
        wrong = [o for o in offsets if mem.load(f"off{o:05d}", default=MISS) != MISS]
        assert wrong == [], f"flips at offsets {wrong} went unnoticed"
        assert _crc_failures(mem) == len(offsets)
    assert _quarantined(path) == sorted(keys)


def test_strict_load_raises_and_regenerate_rebuilds(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    keys = _store_all(path, 2)
    for skey in keys.values():
        _garbage(_file(path, skey), random.Random(1))

    with kvmem.Memory(path, **SETTINGS) as mem:
        with pytest.raises(kvmem.IntegrityError, match="integrity"):
            mem.load("e0", strict=True)
        assert _crc_failures(mem) == 1

        calls: list[int] = []
        fresh = mem.load("e1", regenerate=lambda: calls.append(1) or _value(1))
        assert calls == [1] and _same(fresh, _value(1))
        assert _crc_failures(mem) == 2
    with kvmem.Memory(path, **SETTINGS) as mem:  # the regenerated value was stored, and is intact on disk
        assert _same(mem.load("e1"), _value(1))
        assert mem.load("e0", default=MISS) == MISS
        assert _crc_failures(mem) == 0

    with kvmem.Memory(path, strict=True, **SETTINGS) as mem:  # strict from the config
        _garbage(_file(path, keys["e1"]), random.Random(2))
        with pytest.raises(kvmem.IntegrityError):
            mem.load("e1")


@pytest.mark.parametrize("how", ["swap", "copy"])
def test_entry_files_swapped_or_copied_onto_another_key_never_serve_the_other_value(tmp_path: Path, how: str) -> None:
    """Each file is an intact blob (its CRC matches), just under the wrong name."""
    path = tmp_path / "kvmem"
    keys = _store_all(path, 3)
    a, b = _file(path, keys["e0"]), _file(path, keys["e1"])
    if how == "swap":
        tmp = a.with_suffix(".swap")
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    else:
        shutil.copyfile(b, a)

    with kvmem.Memory(path, **SETTINGS) as mem:
        report = mem.verify(progress=False)
        assert sorted(k for _, k, _ in report.corrupt) == sorted([keys["e0"], keys["e1"]][: 2 if how == "swap" else 1])
        got = {name: mem.load(name, default=MISS) for name in ("e0", "e1", "e2")}
        assert got["e0"] == MISS
        assert got["e1"] == MISS if how == "swap" else _same(got["e1"], _value(1))
        assert _same(got["e2"], _value(2))
        assert _crc_failures(mem) == 2 * (2 if how == "swap" else 1)  # verify's finding, then the load's
        assert keys["e0"] in _quarantined(path)


def test_random_damage_never_returns_a_wrong_value(tmp_path: Path) -> None:
    """Rounds of random faults on random entries: each load is the right value or a miss, never else."""
    path = tmp_path / "kvmem"
    rng = random.Random(2024)
    n = 24
    keys = _store_all(path, n, compression="none")
    names = sorted(FAULTS)
    damaged: set[str] = set()
    for _ in range(4):
        for i in rng.sample(range(n), 4):
            name = f"e{i}"
            if _file(path, keys[name]).exists():
                FAULTS[rng.choice(names)](_file(path, keys[name]), rng)
                damaged.add(name)
        with kvmem.Memory(path, **SETTINGS) as mem:
            for i in range(n):
                got = mem.load(f"e{i}", default=MISS)
                if f"e{i}" in damaged:
                    assert got == MISS, f"e{i}"
                else:
                    assert _same(got, _value(i)), f"e{i}"
    assert sorted(_quarantined(path)) == sorted(keys[name] for name in damaged)


def test_lz4_and_lossy_entries_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    with kvmem.Memory(path, **SETTINGS) as mem:
        skeys = [
            mem.store(f"c{i}", _value(i), compression=codec)
            for i, codec in enumerate(["none+lz4", "int8+lz4", "int4", "fp16+lz4"])
        ]
    for skey in skeys:
        _flip(lambda n, h: (blobfmt.payload_start(h) + n) // 2)(_file(path, skey), random.Random(skey))
    with kvmem.Memory(path, **SETTINGS) as mem:
        assert [mem.load(f"c{i}", default=MISS) for i in range(4)] == [MISS] * 4
        assert _crc_failures(mem) == 4


# -- the CPU tier -------------------------------------------------------------------------------------


def test_corrupt_cpu_copy_falls_through_to_the_good_disk_copy(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", **VERIFIED) as mem:
        skey = mem.store("e0", _value(0))
        cpu, disk = mem._tiers.tiers
        held = cpu.get(skey)  # the CPU tier's own buffer: a bit flips in RAM
        assert held is not None
        held[held.numel() // 2] ^= 0x10

        assert _same(mem.load("e0"), _value(0))
        assert mem.metrics.value("kvmem_crc_failures_total", tier="cpu") == 1
        assert mem.metrics.value("kvmem_crc_failures_total", tier="disk") == 0
        assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tree") == 1
        assert disk.contains(skey)
        # the good copy was promoted back: the next load is a clean CPU hit
        assert _same(mem.load("e0"), _value(0))
        assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tree") == 1
        assert _crc_failures(mem) == 1


def test_corrupt_copies_in_every_tier_are_a_miss(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", **VERIFIED) as mem:
        skey = mem.store("e0", _value(0))
        held = mem._tiers.tiers[0].get(skey)
        assert held is not None
        held[100] ^= 1
        _zero(_file(tmp_path / "kvmem", skey), random.Random(0))
        assert mem.load("e0", default=MISS) == MISS
        assert mem.metrics.value("kvmem_crc_failures_total", tier="cpu") == 1
        assert mem.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
        assert not mem.contains("e0")


def test_by_default_cpu_loads_trust_the_pages_and_verify_finds_a_flip(tmp_path: Path) -> None:
    """The integrity decision, as built: bytes are checked as they enter RAM, CPU-tier loads trust them."""
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as mem:
        skey = mem.store("e0", _value(0))
        cpu = mem._tiers.tiers[0]
        assert not cpu.checks_crc
        held = cpu.get(skey)
        assert held is not None
        header, start = blobfmt.parse(held)
        k = header["leaves"][0]["parts"]["data"]
        held[start + k["off"]] ^= 0x40  # a bit flips in RAM, after the bytes came in
        assert not _same(mem.load("e0"), _value(0))  # served as it is: no second pass over the pages
        assert mem.metrics.value("kvmem_crc_failures_total", tier="cpu") == 0
        report = mem.verify(fix=True, progress=False)  # the scrub re-checks every page it holds
        assert [(tier, key) for tier, key, _ in report.corrupt] == [("cpu", skey)]
        assert _same(mem.load("e0"), _value(0))  # from disk again


# -- verify -------------------------------------------------------------------------------------------


def test_verify_reports_then_fixes_corrupt_orphan_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    keys = _store_all(path, 5)
    _flip(lambda n, h: n // 2)(_file(path, keys["e0"]), random.Random(0))  # corrupt
    _file(path, keys["e1"]).unlink()  # missing: the catalog row has no data behind it
    with sqlite3.connect(path / "catalog.sqlite3") as db:  # orphan: data without a catalog row
        db.execute("DELETE FROM kvmem_entries WHERE key = ?", (keys["e2"],))

    with kvmem.Memory(path, **SETTINGS) as mem:
        report = mem.verify(fix=False, progress=False)
        assert not report.ok and not report.fixed
        assert [(tier, key) for tier, key, _ in report.corrupt] == [("disk", keys["e0"])]
        assert "CRC32C mismatch" in report.corrupt[0][2]
        assert report.orphans == [keys["e2"]]
        assert report.missing == [keys["e1"]]
        assert report.checked == 4
        assert _crc_failures(mem) == 1
        # fix=False changed nothing
        assert _file(path, keys["e0"]).exists() and _quarantined(path) == []
        assert mem._catalog.get(keys["e2"]) is None and mem._catalog.get(keys["e1"]) is not None

        report = mem.verify(fix=True, progress=False)
        assert report.fixed and len(report.corrupt) == 1
        assert _quarantined(path) == [keys["e0"]] and not _file(path, keys["e0"]).exists()
        assert mem._catalog.get(keys["e1"]) is None
        row = mem._catalog.get(keys["e2"])
        assert row is not None and row.metadata == {"i": 2} and row.user_key == "e2" and row.kind == "tree"

        after = mem.verify(fix=False, progress=False)
        assert after.ok and after.checked == 3
        assert mem.load("e0", default=MISS) == MISS
        assert _same(mem.load("e2"), _value(2)) and _same(mem.load("e3"), _value(3))


def test_verify_checks_the_cpu_tier_too(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as mem:
        skey = mem.store("e0", _value(0))
        held = mem._tiers.tiers[0].get(skey)
        assert held is not None
        held[-1] ^= 0xFF  # the stored CRC itself
        report = mem.verify(fix=True, progress=False)
        assert [(tier, key) for tier, key, _ in report.corrupt] == [("cpu", skey)]
        assert not mem._tiers.tiers[0].contains(skey)
        assert _same(mem.load("e0"), _value(0))  # from disk


# -- an edited catalog --------------------------------------------------------------------------------


def test_edited_catalog_rows_never_change_what_load_returns(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    keys = _store_all(path, 3)
    with sqlite3.connect(path / "catalog.sqlite3") as db:
        db.execute(
            "UPDATE kvmem_entries SET crc = crc + 1, size = 7, stored_size = 3, version = 41, "
            "codec = 'int4', kind = 'bytes' WHERE key = ?",
            (keys["e0"],),
        )
        db.execute("UPDATE kvmem_entries SET key = ? WHERE key = ?", ("f" * 64, keys["e1"]))
        db.execute("DELETE FROM kvmem_entries WHERE key = ?", (keys["e2"],))

    with kvmem.Memory(path, **SETTINGS) as mem:
        for i in range(3):
            assert _same(mem.load(f"e{i}"), _value(i))
        assert _crc_failures(mem) == 0
        # the catalog still numbers versions: the next store of e0 is version 42
        mem.store("e0", _value(10))
        info = mem.info("e0")
        assert info is not None and info.version == 42 and info.kind == "tree"
        assert _same(mem.load("e0"), _value(10))
        report = mem.verify(fix=True, progress=False)
        assert sorted(report.orphans) == sorted([keys["e1"], keys["e2"]])
        assert report.missing == ["f" * 64]
    with kvmem.Memory(path, **SETTINGS) as mem:
        assert mem.verify(progress=False).ok
        assert {row.user_key for row in mem._catalog.rows()} == {"e0", "e1", "e2"}


def test_catalog_rows_deleted_wholesale_loses_no_data(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    keys = _store_all(path, 4)
    with sqlite3.connect(path / "catalog.sqlite3") as db:
        db.execute("DELETE FROM kvmem_entries")
    with kvmem.Memory(path, **SETTINGS) as mem:
        assert all(_same(mem.load(f"e{i}"), _value(i)) for i in range(4))
        assert sorted(mem.verify(fix=True, progress=False).orphans) == sorted(keys.values())
        assert mem.stats().entries == 4
