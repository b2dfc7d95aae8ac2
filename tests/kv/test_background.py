"""WriteBehind: its thread starts with it, and a memory's flush and close wait for what it queued."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from kvmem import Memory
from kvmem.kv.background import WriteBehind


def writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvmem-write-behind")}


def test_the_thread_starts_with_the_writer_not_at_the_first_store() -> None:
    before = writer_threads()
    writer = WriteBehind()
    try:
        started = writer_threads() - before
        assert len(started) == 1 and next(iter(started)).is_alive()
    finally:
        writer.close()


def test_a_memorys_flush_and_close_wait_for_the_stores_a_writer_queued(tmp_path: Path) -> None:
    mem = Memory(tmp_path / "kvmem")
    writer = WriteBehind()
    mem.add_writer(writer)
    gate = threading.Event()

    def slow_store(key: str) -> None:
        gate.wait(5)
        time.sleep(0.05)
        mem.store(key, torch.arange(4), namespace="t")

    writer.submit(lambda: slow_store("a" * 64))
    gate.set()
    mem.flush()
    assert mem.contains("a" * 64, namespace="t")
    writer.submit(lambda: slow_store("b" * 64))
    mem.close()  # NOTE: the store queued before close is done before the tiers close
    with Memory(tmp_path / "kvmem") as again:
        assert torch.equal(again.load("b" * 64, namespace="t"), torch.arange(4))
    writer.close()
