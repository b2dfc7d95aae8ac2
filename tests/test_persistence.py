"""Persistence: what one process stores, another process loads back, bit for bit.

Real processes (``tests/workers.py``), real files, a real SQLite catalog.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvmem
from tests.workers import persistence_values, same

WORKERS = str(Path(__file__).with_name("workers.py"))


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    proc = subprocess.run([sys.executable, WORKERS, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"worker {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("exit_how", ["close", "abort"])
def test_values_stored_by_one_process_load_in_others(tmp_path: Path, exit_how: str) -> None:
    path = str(tmp_path / "kvmem")
    assert _worker("persist-store", path, exit_how).stdout.strip() == "stored"

    expected = persistence_values()
    if exit_how == "close":  # a second, fresh process reads everything back and compares it bit for bit
        assert _worker("persist-load", path).stdout.strip() == f"OK {len(expected)}"

    # and so does this one, with the catalog facts the first process recorded
    with kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB") as mem:
        for key, (value, meta) in expected.items():
            loaded = mem.load(key)
            assert same(loaded, value), key
            info = mem.info(key)
            assert info is not None, key
            assert info.metadata == (meta or {}), key
            assert info.version == (2 if key == "versioned" else 1), key
        assert mem.stats().entries == len(expected)
        assert mem.verify(progress=False).ok


def test_bf16_nan_payload_survives_bit_exact(tmp_path: Path) -> None:
    """Lossless means every bit, NaN payloads included (``torch.equal`` would not see them)."""
    # a quiet NaN with payload, an all-ones NaN, a signalling NaN, a denormal, -0.0
    bits = torch.tensor([0x7FC1, -1, 0x7F81, 0x0001, -0x8000], dtype=torch.int16)
    value = bits.view(torch.bfloat16)
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes=0, disk_bytes="1MiB", fsync="always") as mem:
        mem.store("nan-bits", value)
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes=0, disk_bytes="1MiB") as mem:
        assert mem.load("nan-bits").view(torch.int16).tolist() == bits.tolist()


def _disk(mem: kvmem.Memory) -> kvmem.stores.DiskTier:
    tier = mem._tiers.tiers[-1]
    assert isinstance(tier, kvmem.stores.DiskTier)
    return tier


def test_disk_index_rebuilt_on_open_keeps_lru_order(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    item = torch.arange(4096, dtype=torch.int32)  # every entry has the same size
    with kvmem.Memory(path, cpu_bytes=0, disk_bytes="1MiB") as mem:
        keys = {name: mem.store(name, item + i) for i, name in enumerate("abc")}
        size = _disk(mem).usage() // 3
        for i, name in enumerate("abc"):  # distinct, increasing mtimes in the past
            stamp = time.time() - 100 + i
            os.utime(_disk(mem).path(keys[name]), (stamp, stamp))

    with kvmem.Memory(path, cpu_bytes=0, disk_bytes="1MiB") as mem:
        assert list(_disk(mem).keys()) == [keys["a"], keys["b"], keys["c"]]
        assert mem.load("a") is not None  # a hit touches the file: "a" becomes most recently used

    # room for 3.5 entries: storing a fourth must evict the least recently used one, which is "b" now
    with kvmem.Memory(path, cpu_bytes=0, disk_bytes=int(size * 3.5)) as mem:
        assert list(_disk(mem).keys()) == [keys["b"], keys["c"], keys["a"]]
        assert _disk(mem).usage() == 3 * size
        mem.store("d", item + 3)
        assert mem.load("b", default="gone") == "gone"
        for name in "acd":
            assert torch.equal(mem.load(name), item + "abcd".index(name))
        assert mem.metrics.value("kvmem_evictions_total", tier="disk") == 1


def test_reopen_after_close_in_same_process_sees_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    expected = persistence_values()
    with kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB", fsync="batch") as mem:
        for key, (value, meta) in expected.items():
            mem.store(key, value, metadata=meta)
    with kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB") as mem:
        assert mem._tiers.tiers[0].usage() == 0  # what follows is read from the files
        assert all(same(mem.load(key), value) for key, (value, _) in expected.items())
        assert mem.stats().hits == len(expected)
