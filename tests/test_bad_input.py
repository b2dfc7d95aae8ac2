"""Bad input: every wrong key, value, metadata and setting gets a clear error, and harms nothing stored.

Hostile keys (path fragments, NUL bytes, megabyte keys, lone surrogates) are only
ever hashed: their entries live under a 64-hex-digit name inside the blobs directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmem
from kvmem.keys import is_storage_key

SETTINGS = {"cpu_bytes": "1MiB", "disk_bytes": "4MiB", "fsync": "never"}


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[kvmem.Memory]:
    """A Memory holding two entries that every test checks are still intact afterwards."""
    m = kvmem.Memory(tmp_path / "kvmem", **SETTINGS)
    m.store("keep-tensor", torch.arange(10), metadata={"n": 10})
    m.store("keep-bytes", b"precious")
    yield m
    _assert_intact(m)
    m.close()


def _assert_intact(m: kvmem.Memory) -> None:
    assert torch.equal(m.load("keep-tensor"), torch.arange(10))
    assert m.load("keep-bytes") == b"precious"
    info = m.info("keep-tensor")
    assert info is not None and info.version == 1 and info.metadata == {"n": 10}
    assert m.stats().entries == 2


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "key",
    [1, 1.5, None, ["a"], ("a",), {"a": 1}, object(), torch.tensor(1), np.int64(3)],
    ids=lambda k: type(k).__name__,
)
def test_key_that_is_not_str_or_bytes(mem: kvmem.Memory, key: object) -> None:
    before = _files(Path(mem.config.path))
    with pytest.raises(kvmem.InvalidKeyError, match="expected str or bytes"):
        mem.store(key, b"x")  # type: ignore[arg-type]
    with pytest.raises(kvmem.InvalidKeyError):
        mem.load(key)  # type: ignore[arg-type]
    with pytest.raises(kvmem.InvalidKeyError):
        mem.delete(key)  # type: ignore[arg-type]
    with pytest.raises(kvmem.InvalidKeyError):
        mem.contains(key)  # type: ignore[arg-type]
    assert _files(Path(mem.config.path)) == before


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {1, 2},
        {1: torch.ones(2)},
        {"ok": {("tuple", "key"): 1}},
        np.array([object(), 1], dtype=object),
        {"kv": [torch.ones(2), np.array(["a", None], dtype=object)]},
        complex(1, 2),
        lambda: 1,
        range(3),
    ],
    ids=[
        "object",
        "set",
        "int-dict-key",
        "nested-tuple-key",
        "np-object",
        "nested-np-object",
        "complex",
        "lambda",
        "range",
    ],
)
def test_unsupported_value(mem: kvmem.Memory, value: object) -> None:
    before = _files(Path(mem.config.path))
    with pytest.raises(kvmem.UnsupportedValueError) as err:
        mem.store("keep-tensor", value)  # the key exists: its entry must survive the failed overwrite
    assert isinstance(err.value, TypeError)  # the Python convention, for callers catching TypeError
    assert re.search("accepted|must be str|numeric dtype", str(err.value)), str(err.value)
    assert _files(Path(mem.config.path)) - before == set()


@pytest.mark.parametrize(
    "metadata",
    [
        {"x": object()},
        {"x": {1, 2}},
        {"x": torch.ones(1)},
        {"x": b"bytes"},
        ["not", "a", "dict"],
        "text",
    ],
    ids=["object", "set", "tensor", "bytes", "list", "str"],
)
def test_metadata_that_is_not_json(mem: kvmem.Memory, metadata: object) -> None:
    with pytest.raises(kvmem.UnsupportedValueError, match="metadata"):
        mem.store("keep-bytes", b"replacement", metadata=metadata)  # type: ignore[arg-type]
    assert mem.load("keep-bytes") == b"precious"


def test_value_larger_than_every_tier(mem: kvmem.Memory) -> None:
    before = _files(Path(mem.config.path))
    with pytest.raises(kvmem.CapacityError, match="larger than every tier") as err:
        mem.store("keep-tensor", torch.zeros(5 * 1024 * 1024, dtype=torch.uint8))  # tiers: 1 MiB and 4 MiB
    assert "4194304" in str(err.value) and "'keep-tensor'" in str(err.value)  # the largest tier, the key
    with pytest.raises(kvmem.CapacityError):
        mem.store("new", torch.zeros(5 * 1024 * 1024, dtype=torch.uint8))
    assert not mem.contains("new") and mem.info("new") is None
    assert _files(Path(mem.config.path)) - before == set()


def test_a_value_between_the_tier_sizes_goes_to_the_larger_tier(tmp_path: Path) -> None:
    """Not an error: too big for the CPU tier, it lives on disk only."""
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes="64KiB", disk_bytes="1MiB") as m:
        value = torch.arange(30_000, dtype=torch.int32)  # 120 KB
        skey = m.store("mid", value)
        assert not m._tiers.tiers[0].contains(skey) and m._tiers.tiers[1].contains(skey)
        assert torch.equal(m.load("mid"), value)


HOSTILE_KEYS = {
    "dotdot": "../../etc/passwd",
    "dotdot-bytes": b"../../../../tmp/kvmem-escape",
    "absolute": "/etc/passwd",
    "nul": "\x00",
    "nul-inside": "a\x00b",
    "slash": "a/b",
    "backslash": "..\\..\\windows",
    "dot": ".",
    "empty": "",
    "invalid-utf8-bytes": b"\xff\xfe\x00",
    "newline": "line\nbreak",
    "megabyte": "k" * (1 << 20),
    "megabyte-bytes": bytes(range(256)) * 4096,
    "unicode": "ключ/鍵/🔑/\u202e",
    "lone-surrogate": "\ud800oops",
    "storage-key-lookalike": "a" * 64,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_KEYS))
def test_hostile_keys_are_stored_under_a_digest(tmp_path: Path, name: str) -> None:
    key = HOSTILE_KEYS[name]
    outside_before = set(os.listdir(tmp_path.parent))
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        skey = m.store(key, {"name": name}, metadata={"key": name})
        assert is_storage_key(skey) and skey == m.storage_key(key)
        assert skey != key
        assert m.load(key) == {"name": name}
        info = m.info(key)
        assert info is not None and info.metadata == {"key": name}
        blobs = (tmp_path / "kvmem" / "disk" / "blobs").resolve()
        files = _files(tmp_path)
        entry = [f for f in files if f.suffix == ".kvb"]
        assert [f.name for f in entry] == [f"{skey}.kvb"]
        assert entry[0].resolve().parent.parent == blobs
        assert entry[0].parent.name == skey[:2]
        # nothing anywhere else: only the catalog and the blob file
        assert {f.relative_to(tmp_path).parts[:2] for f in files} <= {
            ("kvmem", "disk"),
            ("kvmem", "catalog.sqlite3"),
            ("kvmem", "catalog.sqlite3-wal"),
            ("kvmem", "catalog.sqlite3-shm"),
        }
        assert m.delete(key) and m.load(key, default="gone") == "gone"
    assert set(os.listdir(tmp_path.parent)) == outside_before
    assert not Path("/tmp/kvmem-escape").exists()


def test_hostile_keys_do_not_collide(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes="8MiB", disk_bytes="32MiB", fsync="never") as m:
        skeys = {name: m.store(key, name) for name, key in HOSTILE_KEYS.items()}
        assert len(set(skeys.values())) == len(HOSTILE_KEYS)
        # "a" * 64 is hashed like any key: it does not address the entry whose storage key it spells
        assert m.load("a" * 64) == "storage-key-lookalike"
        for name, key in HOSTILE_KEYS.items():
            assert m.load(key) == name
        assert m.stats().entries == len(HOSTILE_KEYS)
        # str and bytes spellings of the same characters are the same key
        assert m.load(b"../../etc/passwd") == "dotdot"


def test_namespace_never_escapes_either(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem", **SETTINGS) as m:
        skey = m.store("k", b"v", namespace="../../../etc")
        assert is_storage_key(skey)
        assert m.load("k", namespace="../../../etc") == b"v"
        assert m.load("k", default="other-namespace") == "other-namespace"
    assert {f.relative_to(tmp_path).parts[0] for f in _files(tmp_path)} == {"kvmem"}


def test_disk_tier_refuses_anything_but_a_storage_key(tmp_path: Path) -> None:
    tier = kvmem.stores.DiskTier(tmp_path / "disk", 1 << 20)
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63, "g" * 64, "a" * 64 + "/"):
        with pytest.raises(ValueError, match="64 hex digits"):
            tier.path(bad)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("cpu_bytes", "lots"),
        ("cpu_bytes", -1),
        ("disk_bytes", "12 parsecs"),
        ("gpu_bytes", True),
        ("offload_threshold", 1.5),
        ("offload_threshold", 0),
        ("fsync", "sometimes"),
        ("write_policy", "sideways"),
        ("write_back_queue", 0),
        ("block_size", 0),
        ("prefetch_depth", -1),
        ("compression", "zip"),
        ("compression", "int3+lz4"),
        ("tier_retry_seconds", -1),
        ("strict", "maybe"),
        ("catalog_url", "not a url"),
        ("catalog_url", "mysql://localhost/db"),
        ("remote_url", "ftp://example.com/x"),
    ],
)
def test_bad_setting_names_the_field(tmp_path: Path, setting: str, value: object) -> None:
    with pytest.raises(kvmem.ConfigError, match=setting):
        kvmem.Memory(tmp_path / "kvmem", **{setting: value})


def test_unknown_setting_lists_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(kvmem.ConfigError, match="unknown setting 'cpu_size'.*cpu_bytes"):
        kvmem.Memory(tmp_path / "kvmem", cpu_size="1GiB")


def test_all_tiers_zero_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(kvmem.ConfigError, match="cpu_bytes"):
        kvmem.Memory(tmp_path / "kvmem", cpu_bytes=0, disk_bytes=0)
