"""Concurrency: threads and processes storing, loading, deleting and evicting the same few keys.

Every value names its key and version and carries a payload derived from both
(``tests/workers.py``), so a torn, mixed or misplaced value is detected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.codecs.serialization import check_owner
from tests.workers import CHURN_KEYS, check_value, churn

WORKERS = str(Path(__file__).with_name("workers.py"))


def _files_whole(path: Path) -> int:
    files = [f for f in (path / "disk" / "blobs").rglob("*") if f.is_file()]
    for f in files:
        buf = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
        blobfmt.verify(buf)
        check_owner(blobfmt.parse(buf)[0], f.name.removesuffix(".kvb"))
    return len(files)


def test_eight_threads_on_one_memory(tmp_path: Path) -> None:
    # a CPU tier of a few entries over a disk tier of a few more: stores demote and evict all the time
    mem = kvmem.Memory(tmp_path / "kvmem", cpu_bytes="32KiB", disk_bytes="40KiB", fsync="never")
    errors: list[BaseException] = []
    counts: list[dict[str, int]] = []
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            barrier.wait()
            if n == 7:  # one thread also scrubs and collects while the others run
                for _ in range(5):
                    assert mem.verify(progress=False).corrupt == []
                    mem.gc()
            counts.append(churn(mem, seed=n, ops=250, writer_id=n))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == [], errors

    stats = mem.stats()
    assert stats.crc_failures == 0 and stats.tier_errors == 0
    assert stats.demotions > 0 and stats.evictions > 0, "the tiers were too large to force offload"
    assert sum(c["load_hits"] for c in counts) > 100  # loads did find values, and every one was checked
    for key in CHURN_KEYS:  # what is left is consistent
        value = mem.load(key)
        if value is not None:
            check_value(key, value)
    assert mem.verify(progress=False).corrupt == []
    mem.close()
    _files_whole(tmp_path / "kvmem")


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    """Two processes (two threads each) on one SQLite catalog and one disk tier."""
    path = tmp_path / "kvmem"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKERS, "churn", str(path), str(seed), "150", "2", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed in (1, 2)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"worker failed:\n{out}\n{err[-3000:]}"
        assert out.startswith("OK "), out
        assert " crc=0" in out and " hits=0" not in out, out

    with kvmem.Memory(path, cpu_bytes="32KiB", disk_bytes="40KiB") as mem:
        for key in CHURN_KEYS:
            value = mem.load(key)
            if value is not None:
                check_value(key, value)
        assert mem.verify(progress=False).corrupt == []
    assert _files_whole(path) > 0
    assert not list((path / "disk" / "blobs").rglob("*.tmp"))
